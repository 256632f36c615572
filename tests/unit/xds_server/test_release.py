"""drop(): a list only its caller holds is emptied in pieces; a list someone else holds is left alone."""

from __future__ import annotations

import weakref

from xds_server.release import PIECE, drop


class Item:
    pass


def test_a_list_only_the_caller_holds_is_emptied_and_its_items_freed():
    items = [Item() for _ in range(3 * PIECE + 5)]
    refs = [weakref.ref(i) for i in items]
    assert drop(items) is True
    assert items == [] and all(r() is None for r in refs)


def test_a_list_someone_else_holds_is_left_alone():
    held = {"weights": [Item() for _ in range(10)]}
    mine = held["weights"]
    assert drop(mine) is False
    assert len(held["weights"]) == 10


def test_a_swapped_attribute_is_freed_through_its_local_name():
    class Plane:
        weights = [Item(), Item()]

    plane = Plane()
    plane.weights = [Item(), Item()]
    ref = weakref.ref(plane.weights[0])
    previous, plane.weights = plane.weights, [Item()]
    assert drop(previous) is True and ref() is None and len(plane.weights) == 1
