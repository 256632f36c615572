"""The error object of the picker (ext_proc/errors.py) and of the control plane (xds_server/errors.py:
its routes, the admin API, Envoy's own replies through local_reply_config) are one shape: the same
keys, the same type per status."""

from __future__ import annotations

import json

import pytest

from ext_proc.errors import error_body, error_type
from xds_server import errors
from xds_server.resources import local_reply


@pytest.mark.parametrize("status", [400, 404, 408, 413, 429, 431, 500, 503, 504])
def test_the_two_builders_give_one_shape(status):
    assert errors.error_type(status) == error_type(status)
    assert json.loads(errors.error_json(status, "some_code", "text", "p")) == \
        json.loads(error_body(status, "some-code", "text", "p"))


def test_every_envoy_reply_mapper_writes_the_error_object_with_its_code():
    mappers = local_reply.local_reply_config()["mappers"]
    assert len(mappers) == len(local_reply.LOCAL_REPLIES)
    for m, (code, status, _) in zip(mappers, local_reply.LOCAL_REPLIES, strict=True):
        body = m["body_format_override"]
        assert body["content_type"] == "application/json"
        message = local_reply.MESSAGES.get(code, "%LOCAL_REPLY_BODY%")
        assert body["json_format"] == {"error": {"message": message, "type": error_type(status),
                                                 "param": None, "code": code}}
    assert set(local_reply.MESSAGES) <= {code for code, _, _ in local_reply.LOCAL_REPLIES}


def test_no_mapper_matches_a_status_the_picker_answers_by_status_alone():
    """The picker's own 400, 404, 429 and 503 are local replies too (ext_proc's immediate response): a
    mapper on those statuses alone would rewrite them; they are matched by Envoy's response flags."""
    for _, _, match in local_reply.LOCAL_REPLIES:
        assert not isinstance(match, int) or match not in (400, 404, 429, 503)
