/* ext_proc._wire: the compiled decoders of the picker's two hot messages (see ext_proc/wire.py, where
 * the references are).
 *
 * request_headers(data: bytes) -> (dict[str, bytes], bool) | None
 *
 * Walks a serialized envoy.service.ext_proc.v3.ProcessingRequest on the protobuf wire format and,
 * when it is a request_headers message in the shape Envoy sends, returns what
 * ext_proc.wire.request_headers_py returns for it: {lower-case name: raw_value, or value when
 * raw_value is empty; first occurrence wins} and HttpHeaders.end_of_stream.
 *
 * It accepts less than protobuf does and returns None for the rest (the caller then parses with
 * protobuf, which also reports what is invalid): only these fields, each checked as protobuf checks
 * it (wire type, lengths, varints, UTF-8 of string fields):
 *   ProcessingRequest  2 request_headers (once), 8 metadata_context (empty), 10 observability_mode,
 *                      11 protocol_config (its varint fields 1-3 only);
 *   HttpHeaders        1 headers (once), 3 end_of_stream;
 *   HeaderMap          1 headers (repeated);
 *   HeaderValue        1 key (ASCII: lower-cased as str.lower does), 2 value, 3 raw_value (each once).
 *
 * access_log(schema, data: bytes, cluster_header: str, override_host_header: str) -> list[tuple] | None
 *
 * Walks a serialized envoy.service.accesslog.v3.StreamAccessLogsMessage and returns, per HTTP entry,
 * the tuple ext_proc.wire.access_log_py gives for it (see there), or None when it declines: the
 * caller then parses with protobuf, which also reports what is invalid. Every field of every message
 * is checked as protobuf checks it (tags, wire types, lengths, varints, UTF-8 of string fields, down
 * to the deepest Struct of the Node), by the schema access_log_schema() builds from the installed
 * descriptors (ext_proc.wire); unknown fields are skipped as protobuf skips them. It declines what
 * it does not decode exactly as protobuf would: groups, a known field in another wire type (packed
 * or mismatched), a message it reads appearing twice in one parent (protobuf merges them), unknown
 * fields in a header map entry, a read uint32 above 2^32-1 or bool above 1, Duration nanos outside
 * int32 or seconds beyond +-9e9, nesting deeper than MAX_DEPTH. The fields it reads (numbers from
 * envoy/service/accesslog/v3/als.proto, envoy/data/accesslog/v3/accesslog.proto,
 * envoy/config/core/v3/address.proto, google/protobuf/duration.proto and wrappers.proto, as the
 * descriptors of xds-protos 1.85.0 give them; exported as ACCESS_LOG_FIELDS, which
 * tests/unit/ext_proc/test_wire_access_log.py compares with the installed descriptors):
 *   StreamAccessLogsMessage  2 http_logs (oneof log_entries; repeated: entries add up),
 *                            3 tcp_logs (oneof: drops the HTTP entries before it);
 *   HTTPAccessLogEntries     1 log_entry (repeated);
 *   HTTPAccessLogEntry       1 common_properties, 3 request, 4 response;
 *   AccessLogCommon          7 time_to_first_upstream_tx_byte, 9 time_to_first_upstream_rx_byte,
 *                            10 time_to_last_upstream_rx_byte, 12 time_to_last_downstream_tx_byte
 *                            (Durations), 13 upstream_remote_address, 16 response_flags,
 *                            24 upstream_request_attempt_count (uint32);
 *   ResponseFlags            5 upstream_remote_reset, 6 upstream_connection_failure,
 *                            7 upstream_connection_termination (bool);
 *   Address                  1 socket_address (oneof address with 2 pipe, 3 envoy_internal_address);
 *   SocketAddress            2 address, 3 port_value (uint32; oneof port_specifier with 4 named_port);
 *   Duration                 1 seconds (int64), 2 nanos (int32);
 *   HTTPRequestProperties    9 request_id, 13 request_headers (map<string, string>: entry 1 key,
 *                            2 value; the last entry of a key wins);
 *   HTTPResponseProperties   1 response_code (UInt32Value: 1 value).
 *
 * assignment_endpoints(data: bytes) -> list[tuple] | None
 *
 * Walks a serialized envoy.config.endpoint.v3.ClusterLoadAssignment (one the picker's view has as a
 * message and serialises: ext_proc/eds_wire.py) and returns, per LocalityLbEndpoints, the tuple
 * ext_proc.eds_wire.assignment_endpoints_py gives for it, metadata as its bytes; None when it
 * declines (malformed bytes, groups, a read field in another wire type, a singular message field
 * twice, or a oneof member clearing a read one after it). Fields read (numbers from
 * envoy/config/endpoint/v3/endpoint.proto, endpoint_components.proto, envoy/config/core/v3/address.proto):
 *   ClusterLoadAssignment  2 endpoints (repeated);
 *   LocalityLbEndpoints    2 lb_endpoints (repeated), 5 priority, 9 metadata;
 *   LbEndpoint             1 endpoint (oneof with 5 endpoint_name), 2 health_status, 3 metadata,
 *                          4 load_balancing_weight (UInt32Value: 1 value);
 *   Endpoint 1 address; Address 1 socket_address (oneof with 2 pipe, 3 envoy_internal_address);
 *   SocketAddress          2 address, 3 port_value (oneof with 4 named_port).
 * Every other field is skipped by its wire type.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef const unsigned char *ptr;

/* A varint of at most 10 bytes whose value fits 64 bits; 0 when malformed. */
static int varint_long(ptr *p, ptr end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
        unsigned char b = *(*p)++;
        if (shift == 63 && b > 1)
            return 0;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

static inline int varint(ptr *p, ptr end, uint64_t *out)
{
    if (*p < end && !(**p & 0x80)) { /* one byte: most tags and lengths */
        *out = *(*p)++;
        return 1;
    }
    return varint_long(p, end, out);
}

/* A tag: field number (1 .. 2^29-1) and wire type; 0 when malformed. */
static inline int tag(ptr *p, ptr end, uint32_t *field, unsigned *wire)
{
    uint64_t t;
    if (!varint(p, end, &t) || t > 0xFFFFFFFFu || (t >> 3) == 0)
        return 0;
    *field = (uint32_t)(t >> 3);
    *wire = (unsigned)(t & 7);
    return 1;
}

/* A length-delimited payload: [*start, *start + *len) within end; 0 when malformed. */
static inline int delimited(ptr *p, ptr end, ptr *start, Py_ssize_t *len)
{
    uint64_t n;
    if (!varint(p, end, &n) || n > (uint64_t)(end - *p))
        return 0;
    *start = *p;
    *len = (Py_ssize_t)n;
    *p += n;
    return 1;
}

static int valid_utf8(ptr s, Py_ssize_t n)
{
    PyObject *u = PyUnicode_DecodeUTF8((const char *)s, n, "strict");
    if (u == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(u);
    return 1;
}

/* 1: added (or already there) to headers; 0: not handled (return None); -1: Python error. */
static int header_value(ptr p, ptr end, PyObject *headers)
{
    ptr key = NULL, value = NULL, raw = NULL;
    Py_ssize_t key_n = 0, value_n = 0, raw_n = 0;
    int seen = 0;
    while (p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        if (!tag(&p, end, &field, &wire) || wire != 2 || field < 1 || field > 3 || (seen & (1 << field)))
            return 0;
        seen |= 1 << field;
        if (!delimited(&p, end, &s, &n))
            return 0;
        if (field == 1) {
            key = s;
            key_n = n;
        } else if (field == 2) {
            value = s;
            value_n = n;
        } else {
            raw = s;
            raw_n = n;
        }
    }
    if (value_n && !valid_utf8(value, value_n))
        return 0;
    PyObject *name = PyUnicode_New(key_n, 127);
    if (name == NULL)
        return -1;
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(name);
    for (Py_ssize_t i = 0; i < key_n; i++) {
        unsigned char c = key[i];
        if (c >= 0x80) { /* non-ASCII: str.lower's Unicode rules are protobuf's caller's job */
            Py_DECREF(name);
            return 0;
        }
        out[i] = (c >= 'A' && c <= 'Z') ? (Py_UCS1)(c + 32) : c;
    }
    int present = PyDict_Contains(headers, name);
    if (present != 0) {
        Py_DECREF(name);
        return present < 0 ? -1 : 1;
    }
    PyObject *bytes = raw_n ? PyBytes_FromStringAndSize((const char *)raw, raw_n)
                            : PyBytes_FromStringAndSize((const char *)(value ? value : raw), value_n);
    if (bytes == NULL) {
        Py_DECREF(name);
        return -1;
    }
    int rc = PyDict_SetItem(headers, name, bytes);
    Py_DECREF(name);
    Py_DECREF(bytes);
    return rc < 0 ? -1 : 1;
}

static int header_map(ptr p, ptr end, PyObject *headers)
{
    while (p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        if (!tag(&p, end, &field, &wire) || field != 1 || wire != 2 || !delimited(&p, end, &s, &n))
            return 0;
        int rc = header_value(s, s + n, headers);
        if (rc != 1)
            return rc;
    }
    return 1;
}

/* HttpHeaders: 1 = handled, 0 = not, -1 = error; *eos = end_of_stream. */
static int http_headers(ptr p, ptr end, PyObject *headers, int *eos)
{
    int map_seen = 0;
    while (p < end) {
        uint32_t field;
        unsigned wire;
        if (!tag(&p, end, &field, &wire))
            return 0;
        if (field == 1 && wire == 2 && !map_seen) {
            ptr s;
            Py_ssize_t n;
            map_seen = 1;
            if (!delimited(&p, end, &s, &n))
                return 0;
            int rc = header_map(s, s + n, headers);
            if (rc != 1)
                return rc;
        } else if (field == 3 && wire == 0) {
            uint64_t v;
            if (!varint(&p, end, &v))
                return 0;
            *eos = v != 0;
        } else {
            return 0;
        }
    }
    return 1;
}

/* ProtocolConfiguration with varint fields 1-3 only. */
static int protocol_config(ptr p, ptr end)
{
    while (p < end) {
        uint32_t field;
        unsigned wire;
        uint64_t v;
        if (!tag(&p, end, &field, &wire) || wire != 0 || field < 1 || field > 3 || !varint(&p, end, &v))
            return 0;
    }
    return 1;
}

static PyObject *request_headers(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ptr p = view.buf, end = p + view.len, hh = NULL, hh_end = NULL;
    int ok = 1;
    while (ok && p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        uint64_t v;
        if (!tag(&p, end, &field, &wire)) {
            ok = 0;
        } else if (field == 2 && wire == 2 && hh == NULL) {
            ok = delimited(&p, end, &s, &n);
            hh = s;
            hh_end = s + n;
        } else if (field == 8 && wire == 2) {
            ok = delimited(&p, end, &s, &n) && n == 0;
        } else if (field == 10 && wire == 0) {
            ok = varint(&p, end, &v);
        } else if (field == 11 && wire == 2) {
            ok = delimited(&p, end, &s, &n) && protocol_config(s, s + n);
        } else {
            ok = 0;
        }
    }
    PyObject *result = NULL;
    if (ok && hh != NULL) {
        PyObject *headers = PyDict_New();
        int eos = 0;
        int rc = headers == NULL ? -1 : http_headers(hh, hh_end, headers, &eos);
        if (rc == 1)
            result = Py_BuildValue("(NO)", headers, eos ? Py_True : Py_False);
        else
            Py_XDECREF(headers);
        if (rc == 0)
            result = Py_NewRef(Py_None);
    } else {
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

/* HttpBody with body (1, once) and end_of_stream (2) only: 1 = handled, 0 = not. */
static int http_body(ptr p, ptr end, ptr *body, Py_ssize_t *body_n, int *eos)
{
    int body_seen = 0;
    while (p < end) {
        uint32_t field;
        unsigned wire;
        if (!tag(&p, end, &field, &wire))
            return 0;
        if (field == 1 && wire == 2 && !body_seen) {
            body_seen = 1;
            if (!delimited(&p, end, body, body_n))
                return 0;
        } else if (field == 2 && wire == 0) {
            uint64_t v;
            if (!varint(&p, end, &v))
                return 0;
            *eos = v != 0;
        } else {
            return 0;
        }
    }
    return 1;
}

static PyObject *request_body(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ptr p = view.buf, end = p + view.len, hb = NULL, hb_end = NULL;
    int ok = 1;
    while (ok && p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        uint64_t v;
        if (!tag(&p, end, &field, &wire)) {
            ok = 0;
        } else if (field == 4 && wire == 2 && hb == NULL) {
            ok = delimited(&p, end, &s, &n);
            hb = s;
            hb_end = s + n;
        } else if (field == 8 && wire == 2) {
            ok = delimited(&p, end, &s, &n) && n == 0;
        } else if (field == 10 && wire == 0) {
            ok = varint(&p, end, &v);
        } else if (field == 11 && wire == 2) {
            ok = delimited(&p, end, &s, &n) && protocol_config(s, s + n);
        } else {
            ok = 0;
        }
    }
    PyObject *result = NULL;
    ptr body = NULL;
    Py_ssize_t body_n = 0;
    int eos = 0;
    if (ok && hb != NULL && http_body(hb, hb_end, &body, &body_n, &eos)) {
        PyObject *bytes = PyBytes_FromStringAndSize((const char *)body, body_n);
        if (bytes != NULL)
            result = Py_BuildValue("(NO)", bytes, eos ? Py_True : Py_False);
    } else {
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

/* ---- The access-log decoder ---- */

/* What the schema says of a field: how to check it (the wire type it must come in follows). */
enum kind { K_UNKNOWN, K_VARINT, K_FIXED64, K_FIXED32, K_BYTES, K_STRING, K_MESSAGE, K_DECLINE, K_KINDS };
static const unsigned wire_of[K_KINDS] = {0, 0, 1, 5, 2, 2, 2, 0};

/* The messages the decoder reads itself: the first entries of every schema, in this order
 * (ACCESS_LOG_MESSAGES); the schema appends every other message reachable from them. */
enum {
    M_MESSAGE, M_ENTRIES, M_ENTRY, M_COMMON, M_FLAGS, M_ADDRESS, M_SOCKET_ADDRESS, M_DURATION, M_REQUEST,
    M_HEADER_ENTRY, M_RESPONSE, M_UINT32, M_READ
};
static const char *const read_messages[M_READ] = {
    "envoy.service.accesslog.v3.StreamAccessLogsMessage",
    "envoy.service.accesslog.v3.StreamAccessLogsMessage.HTTPAccessLogEntries",
    "envoy.data.accesslog.v3.HTTPAccessLogEntry",
    "envoy.data.accesslog.v3.AccessLogCommon",
    "envoy.data.accesslog.v3.ResponseFlags",
    "envoy.config.core.v3.Address",
    "envoy.config.core.v3.SocketAddress",
    "google.protobuf.Duration",
    "envoy.data.accesslog.v3.HTTPRequestProperties",
    "envoy.data.accesslog.v3.HTTPRequestProperties.RequestHeadersEntry",
    "envoy.data.accesslog.v3.HTTPResponseProperties",
    "google.protobuf.UInt32Value",
};

/* The field numbers read (the wire format facts: see the top of this file). */
#define F_HTTP_LOGS 2
#define F_TCP_LOGS 3
#define F_LOG_ENTRY 1
#define F_COMMON_PROPERTIES 1
#define F_REQUEST 3
#define F_RESPONSE 4
#define F_FIRST_UPSTREAM_TX 7
#define F_FIRST_UPSTREAM_RX 9
#define F_LAST_UPSTREAM_RX 10
#define F_LAST_DOWNSTREAM_TX 12
#define F_UPSTREAM_REMOTE_ADDRESS 13
#define F_RESPONSE_FLAGS 16
#define F_ATTEMPT_COUNT 24
#define F_UPSTREAM_REMOTE_RESET 5
#define F_UPSTREAM_CONNECTION_FAILURE 6
#define F_UPSTREAM_CONNECTION_TERMINATION 7
#define F_SOCKET_ADDRESS 1
#define F_PIPE 2
#define F_ENVOY_INTERNAL_ADDRESS 3
#define F_ADDRESS 2
#define F_PORT_VALUE 3
#define F_NAMED_PORT 4
#define F_SECONDS 1
#define F_NANOS 2
#define F_REQUEST_ID 9
#define F_REQUEST_HEADERS 13
#define F_KEY 1
#define F_VALUE 2
#define F_RESPONSE_CODE 1
#define F_UINT32_VALUE 1

static const struct { int message; const char *name; int number; } read_fields[] = {
    {M_MESSAGE, "http_logs", F_HTTP_LOGS}, {M_MESSAGE, "tcp_logs", F_TCP_LOGS},
    {M_ENTRIES, "log_entry", F_LOG_ENTRY},
    {M_ENTRY, "common_properties", F_COMMON_PROPERTIES}, {M_ENTRY, "request", F_REQUEST},
    {M_ENTRY, "response", F_RESPONSE},
    {M_COMMON, "time_to_first_upstream_tx_byte", F_FIRST_UPSTREAM_TX},
    {M_COMMON, "time_to_first_upstream_rx_byte", F_FIRST_UPSTREAM_RX},
    {M_COMMON, "time_to_last_upstream_rx_byte", F_LAST_UPSTREAM_RX},
    {M_COMMON, "time_to_last_downstream_tx_byte", F_LAST_DOWNSTREAM_TX},
    {M_COMMON, "upstream_remote_address", F_UPSTREAM_REMOTE_ADDRESS},
    {M_COMMON, "response_flags", F_RESPONSE_FLAGS},
    {M_COMMON, "upstream_request_attempt_count", F_ATTEMPT_COUNT},
    {M_FLAGS, "upstream_remote_reset", F_UPSTREAM_REMOTE_RESET},
    {M_FLAGS, "upstream_connection_failure", F_UPSTREAM_CONNECTION_FAILURE},
    {M_FLAGS, "upstream_connection_termination", F_UPSTREAM_CONNECTION_TERMINATION},
    {M_ADDRESS, "socket_address", F_SOCKET_ADDRESS}, {M_ADDRESS, "pipe", F_PIPE},
    {M_ADDRESS, "envoy_internal_address", F_ENVOY_INTERNAL_ADDRESS},
    {M_SOCKET_ADDRESS, "address", F_ADDRESS}, {M_SOCKET_ADDRESS, "port_value", F_PORT_VALUE},
    {M_SOCKET_ADDRESS, "named_port", F_NAMED_PORT},
    {M_DURATION, "seconds", F_SECONDS}, {M_DURATION, "nanos", F_NANOS},
    {M_REQUEST, "request_id", F_REQUEST_ID}, {M_REQUEST, "request_headers", F_REQUEST_HEADERS},
    {M_HEADER_ENTRY, "key", F_KEY}, {M_HEADER_ENTRY, "value", F_VALUE},
    {M_RESPONSE, "response_code", F_RESPONSE_CODE},
    {M_UINT32, "value", F_UINT32_VALUE},
};

#define MAX_DEPTH 64 /* protobuf's own limit is 100: deeper is left to it */
#define DURATIONS 4  /* in the tuple's order: first upstream tx, last upstream rx, last downstream tx, first upstream rx */

typedef struct {
    unsigned char kind;
    unsigned short sub; /* K_MESSAGE: the message's index in the schema */
} field_t;

typedef struct {
    Py_ssize_t n; /* fields[number] for number < n; K_UNKNOWN beyond */
    field_t *fields;
} message_t;

typedef struct {
    Py_ssize_t n;
    message_t *messages;
} schema_t;

/* UTF-8 as protobuf checks it: ASCII 8 bytes at a time, the rest by CPython's strict decoder. */
static int valid_utf8_fast(ptr s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (uint64_t w; i + 8 <= n; i += 8) {
        memcpy(&w, s + i, 8);
        if (w & 0x8080808080808080u)
            break;
    }
    for (; i < n; i++)
        if (s[i] & 0x80)
            return valid_utf8(s + i, n - i); /* after ASCII, a character starts here */
    return 1;
}

static int check_field(const schema_t *schema, int m, uint32_t field, unsigned wire, ptr *p, ptr end, int depth);

/* Message m over [p, end): 1 when protobuf parses it, 0 when unsure (decline). */
static int check_message(const schema_t *schema, int m, ptr p, ptr end, int depth)
{
    if (depth > MAX_DEPTH)
        return 0;
    while (p < end) {
        uint32_t field;
        unsigned wire;
        if (!tag(&p, end, &field, &wire) || !check_field(schema, m, field, wire, &p, end, depth))
            return 0;
    }
    return 1;
}

/* One field of message m after its tag, as protobuf would take it: skips it, 0 when unsure. */
static int check_field(const schema_t *schema, int m, uint32_t field, unsigned wire, ptr *p, ptr end, int depth)
{
    const message_t *msg = &schema->messages[m];
    field_t f = (Py_ssize_t)field < msg->n ? msg->fields[field] : (field_t){K_UNKNOWN, 0};
    if (f.kind == K_DECLINE || (f.kind != K_UNKNOWN && wire != wire_of[f.kind]))
        return 0;
    ptr s;
    Py_ssize_t n;
    uint64_t v;
    switch (wire) {
    case 0:
        return varint(p, end, &v);
    case 1:
    case 5: {
        Py_ssize_t size = wire == 1 ? 8 : 4;
        if (end - *p < size)
            return 0;
        *p += size;
        return 1;
    }
    case 2:
        if (!delimited(p, end, &s, &n))
            return 0;
        if (f.kind == K_STRING)
            return valid_utf8_fast(s, n);
        if (f.kind == K_MESSAGE)
            return check_message(schema, f.sub, s, s + n, depth + 1);
        return 1;
    default: /* groups (3, 4) and the invalid wire types 6, 7 */
        return 0;
    }
}

/* What one HTTP entry's tuple is made of (pointers into the message). */
typedef struct {
    ptr cluster, pin, request_id, address;
    Py_ssize_t cluster_n, pin_n, request_id_n, address_n;
    int has_cluster, has_pin, remote_reset, connection_failure, termination, has_ns[DURATIONS];
    uint64_t attempts, port, code;
    long long ns[DURATIONS];
    const char *cluster_header, *override_host_header;
    Py_ssize_t cluster_header_n, override_host_header_n;
} entry_t;

/* Shared shape of the readers: 1 = read, 0 = decline. */
#define NEXT_TAG()                                                                                             \
    uint32_t field;                                                                                            \
    unsigned wire;                                                                                             \
    ptr s;                                                                                                     \
    Py_ssize_t n;                                                                                              \
    uint64_t v;                                                                                                \
    (void)s, (void)n, (void)v;                                                                                 \
    if (!tag(&p, end, &field, &wire))                                                                          \
        return 0;
#define ONCE(bit)                                                                                              \
    do {                                                                                                       \
        if (seen & (1u << (bit)))                                                                              \
            return 0;                                                                                          \
        seen |= 1u << (bit);                                                                                   \
    } while (0)
#define CHECK(m)                                                                                               \
    do {                                                                                                       \
        if (!check_field(schema, (m), field, wire, &p, end, depth))                                            \
            return 0;                                                                                          \
    } while (0)

static int uint32_value(const schema_t *schema, ptr p, ptr end, int depth, uint64_t *out)
{
    while (p < end) {
        NEXT_TAG();
        if (field == F_UINT32_VALUE && wire == 0) {
            if (!varint(&p, end, &v) || v > 0xFFFFFFFFu)
                return 0;
            *out = v;
        } else {
            CHECK(M_UINT32);
        }
    }
    return 1;
}

static int duration(const schema_t *schema, ptr p, ptr end, int depth, long long *ns)
{
    int64_t seconds = 0, nanos = 0;
    while (p < end) {
        NEXT_TAG();
        if ((field == F_SECONDS || field == F_NANOS) && wire == 0) {
            if (!varint(&p, end, &v))
                return 0;
            if (field == F_SECONDS)
                seconds = (int64_t)v;
            else if ((int64_t)v < INT32_MIN || (int64_t)v > INT32_MAX)
                return 0;
            else
                nanos = (int64_t)v;
        } else {
            CHECK(M_DURATION);
        }
    }
    if (seconds > 9000000000LL || seconds < -9000000000LL)
        return 0;
    *ns = seconds * 1000000000LL + nanos;
    return 1;
}

static int socket_address(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    while (p < end) {
        NEXT_TAG();
        if (field == F_ADDRESS && wire == 2) {
            if (!delimited(&p, end, &s, &n) || !valid_utf8_fast(s, n))
                return 0;
            e->address = s;
            e->address_n = n;
        } else if (field == F_PORT_VALUE && wire == 0) {
            if (!varint(&p, end, &v) || v > 0xFFFFFFFFu)
                return 0;
            e->port = v;
        } else {
            CHECK(M_SOCKET_ADDRESS);
            if (field == F_NAMED_PORT) /* the other member of the port_specifier oneof */
                e->port = 0;
        }
    }
    return 1;
}

static int address(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        NEXT_TAG();
        if (field == F_SOCKET_ADDRESS && wire == 2) {
            ONCE(0);
            if (!delimited(&p, end, &s, &n) || !socket_address(schema, s, s + n, depth + 1, e))
                return 0;
        } else {
            CHECK(M_ADDRESS);
            if (field == F_PIPE || field == F_ENVOY_INTERNAL_ADDRESS) { /* the address oneof's others */
                e->address_n = 0;
                e->port = 0;
            }
        }
    }
    return 1;
}

static int response_flags(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    while (p < end) {
        NEXT_TAG();
        if (field >= F_UPSTREAM_REMOTE_RESET && field <= F_UPSTREAM_CONNECTION_TERMINATION && wire == 0) {
            if (!varint(&p, end, &v) || v > 1)
                return 0;
            if (field == F_UPSTREAM_REMOTE_RESET)
                e->remote_reset = (int)v;
            else if (field == F_UPSTREAM_CONNECTION_FAILURE)
                e->connection_failure = (int)v;
            else
                e->termination = (int)v;
        } else {
            CHECK(M_FLAGS);
        }
    }
    return 1;
}

static int common_properties(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        NEXT_TAG();
        int slot = field == F_FIRST_UPSTREAM_TX    ? 0
                   : field == F_LAST_UPSTREAM_RX   ? 1
                   : field == F_LAST_DOWNSTREAM_TX ? 2
                   : field == F_FIRST_UPSTREAM_RX  ? 3
                                                   : -1;
        if (slot >= 0 && wire == 2) {
            ONCE(slot);
            if (!delimited(&p, end, &s, &n) || !duration(schema, s, s + n, depth + 1, &e->ns[slot]))
                return 0;
            e->has_ns[slot] = 1;
        } else if (field == F_UPSTREAM_REMOTE_ADDRESS && wire == 2) {
            ONCE(DURATIONS);
            if (!delimited(&p, end, &s, &n) || !address(schema, s, s + n, depth + 1, e))
                return 0;
        } else if (field == F_RESPONSE_FLAGS && wire == 2) {
            ONCE(DURATIONS + 1);
            if (!delimited(&p, end, &s, &n) || !response_flags(schema, s, s + n, depth + 1, e))
                return 0;
        } else if (field == F_ATTEMPT_COUNT && wire == 0) {
            if (!varint(&p, end, &v) || v > 0xFFFFFFFFu)
                return 0;
            e->attempts = v;
        } else {
            CHECK(M_COMMON);
        }
    }
    return 1;
}

static int header_entry(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    ptr key = NULL, value = NULL;
    Py_ssize_t key_n = 0, value_n = 0;
    while (p < end) {
        NEXT_TAG();
        if ((field != F_KEY && field != F_VALUE) || wire != 2) /* unknown fields in a map entry: unsure */
            return 0;
        if (!delimited(&p, end, &s, &n) || !valid_utf8_fast(s, n))
            return 0;
        if (field == F_KEY) {
            key = s;
            key_n = n;
        } else {
            value = s;
            value_n = n;
        }
    }
    (void)schema, (void)depth;
    if (key_n == e->cluster_header_n && (key_n == 0 || memcmp(key, e->cluster_header, key_n) == 0)) {
        e->has_cluster = 1;
        e->cluster = value;
        e->cluster_n = value_n;
    }
    if (key_n == e->override_host_header_n && (key_n == 0 || memcmp(key, e->override_host_header, key_n) == 0)) {
        e->has_pin = 1;
        e->pin = value;
        e->pin_n = value_n;
    }
    return 1;
}

static int request(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    while (p < end) {
        NEXT_TAG();
        if (field == F_REQUEST_ID && wire == 2) {
            if (!delimited(&p, end, &s, &n) || !valid_utf8_fast(s, n))
                return 0;
            e->request_id = s;
            e->request_id_n = n;
        } else if (field == F_REQUEST_HEADERS && wire == 2) {
            if (!delimited(&p, end, &s, &n) || !header_entry(schema, s, s + n, depth + 1, e))
                return 0;
        } else {
            CHECK(M_REQUEST);
        }
    }
    return 1;
}

static int response(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        NEXT_TAG();
        if (field == F_RESPONSE_CODE && wire == 2) {
            ONCE(0);
            if (!delimited(&p, end, &s, &n) || !uint32_value(schema, s, s + n, depth + 1, &e->code))
                return 0;
        } else {
            CHECK(M_RESPONSE);
        }
    }
    return 1;
}

static int entry(const schema_t *schema, ptr p, ptr end, int depth, entry_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        NEXT_TAG();
        if ((field == F_COMMON_PROPERTIES || field == F_REQUEST || field == F_RESPONSE) && wire == 2) {
            ONCE(field);
            if (!delimited(&p, end, &s, &n))
                return 0;
            int ok = field == F_COMMON_PROPERTIES ? common_properties(schema, s, s + n, depth + 1, e)
                     : field == F_REQUEST         ? request(schema, s, s + n, depth + 1, e)
                                                  : response(schema, s, s + n, depth + 1, e);
            if (!ok)
                return 0;
        } else {
            CHECK(M_ENTRY);
        }
    }
    return 1;
}

static PyObject *str_or_none(int present, ptr s, Py_ssize_t n)
{
    return present ? PyUnicode_DecodeUTF8((const char *)s, n, "strict") : Py_NewRef(Py_None);
}

/* The entry's tuple (see ext_proc.wire.access_log_py); NULL with an exception set. */
static PyObject *entry_tuple(const entry_t *e)
{
    PyObject *t = PyTuple_New(8 + DURATIONS);
    if (t == NULL)
        return NULL;
    PyTuple_SET_ITEM(t, 0, str_or_none(e->has_cluster, e->cluster, e->cluster_n));
    PyTuple_SET_ITEM(t, 1, str_or_none(e->has_pin, e->pin, e->pin_n));
    PyTuple_SET_ITEM(t, 2, PyBytes_FromStringAndSize((const char *)e->request_id, e->request_id_n));
    PyTuple_SET_ITEM(t, 3, PyBool_FromLong(e->remote_reset || e->connection_failure || e->termination));
    PyTuple_SET_ITEM(t, 4, PyLong_FromUnsignedLongLong(e->attempts));
    PyTuple_SET_ITEM(t, 5, PyUnicode_DecodeUTF8((const char *)e->address, e->address_n, "strict"));
    PyTuple_SET_ITEM(t, 6, PyLong_FromUnsignedLongLong(e->port));
    for (int i = 0; i < DURATIONS; i++)
        PyTuple_SET_ITEM(t, 7 + i, e->has_ns[i] ? PyLong_FromLongLong(e->ns[i]) : Py_NewRef(Py_None));
    PyTuple_SET_ITEM(t, 7 + DURATIONS, PyLong_FromUnsignedLongLong(e->code));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        if (PyTuple_GET_ITEM(t, i) == NULL) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

/* HTTPAccessLogEntries: appends one tuple per entry; 1 = read, 0 = decline, -1 = Python error. */
static int entries(const schema_t *schema, ptr p, ptr end, int depth, const entry_t *names, PyObject *out)
{
    while (p < end) {
        NEXT_TAG();
        if (field == F_LOG_ENTRY && wire == 2) {
            entry_t e = *names;
            if (!delimited(&p, end, &s, &n) || !entry(schema, s, s + n, depth + 1, &e))
                return 0;
            PyObject *t = entry_tuple(&e);
            if (t == NULL)
                return -1;
            int rc = PyList_Append(out, t);
            Py_DECREF(t);
            if (rc < 0)
                return -1;
        } else {
            CHECK(M_ENTRIES);
        }
    }
    return 1;
}

#define SCHEMA_CAPSULE "ext_proc._wire.access_log_schema"

static PyObject *access_log(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "access_log(schema, data, cluster_header, override_host_header)");
        return NULL;
    }
    const schema_t *schema = PyCapsule_GetPointer(args[0], SCHEMA_CAPSULE);
    if (schema == NULL)
        return NULL;
    entry_t names = {0};
    names.cluster_header = PyUnicode_AsUTF8AndSize(args[2], &names.cluster_header_n);
    names.override_host_header = PyUnicode_AsUTF8AndSize(args[3], &names.override_host_header_n);
    if (names.cluster_header == NULL || names.override_host_header == NULL)
        return NULL;
    names.address = names.request_id = (ptr) "";
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    int rc = out == NULL ? -1 : 1;
    ptr p = view.buf, end = p + view.len;
    const int depth = 0;
    while (rc == 1 && p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        if (!tag(&p, end, &field, &wire)) {
            rc = 0;
        } else if (field == F_HTTP_LOGS && wire == 2) {
            rc = delimited(&p, end, &s, &n) ? entries(schema, s, s + n, depth + 1, &names, out) : 0;
        } else {
            rc = check_field(schema, M_MESSAGE, field, wire, &p, end, depth);
            if (rc == 1 && field == F_TCP_LOGS) /* the other member of the log_entries oneof */
                rc = PyList_SetSlice(out, 0, PyList_GET_SIZE(out), NULL) < 0 ? -1 : 1;
        }
    }
    PyBuffer_Release(&view);
    if (rc == 1)
        return out;
    Py_XDECREF(out);
    return rc == 0 ? Py_NewRef(Py_None) : NULL;
}

static void schema_free(PyObject *capsule)
{
    schema_t *schema = PyCapsule_GetPointer(capsule, SCHEMA_CAPSULE);
    if (schema == NULL)
        return;
    for (Py_ssize_t i = 0; i < schema->n; i++)
        PyMem_Free(schema->messages[i].fields);
    PyMem_Free(schema->messages);
    PyMem_Free(schema);
}

/* access_log_schema(messages) -> capsule: messages[i] = the fields of message i, each
 * (number, kind, index of its message type or 0); the first ones are ACCESS_LOG_MESSAGES. */
static PyObject *access_log_schema(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "access_log_schema: a sequence of messages");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    schema_t *schema = PyMem_Calloc(1, sizeof *schema);
    message_t *messages = PyMem_Calloc(count ? count : 1, sizeof *messages);
    PyObject *capsule = NULL;
    if (schema == NULL || messages == NULL) {
        PyErr_NoMemory();
        PyMem_Free(schema);
        PyMem_Free(messages);
        Py_DECREF(seq);
        return NULL;
    }
    schema->messages = messages;
    schema->n = count;
    capsule = PyCapsule_New(schema, SCHEMA_CAPSULE, schema_free); /* frees what is built so far */
    if (capsule == NULL) {
        PyMem_Free(messages);
        PyMem_Free(schema);
        Py_DECREF(seq);
        return NULL;
    }
    if (count < M_READ) {
        PyErr_Format(PyExc_ValueError, "access_log_schema: %d messages needed, got %zd", M_READ, count);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *fields = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i), "access_log_schema: fields");
        if (fields == NULL)
            goto fail;
        Py_ssize_t nf = PySequence_Fast_GET_SIZE(fields), max = 0;
        long number, kind, sub;
        for (Py_ssize_t j = 0; j < nf; j++) {
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fields, j), "lll", &number, &kind, &sub)
                || number <= 0 || number >= (1L << 29) || kind <= K_UNKNOWN || kind >= K_KINDS || sub < 0
                || sub >= count || (kind != K_MESSAGE && sub != 0)) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "access_log_schema: bad field in message %zd", i);
                Py_DECREF(fields);
                goto fail;
            }
            if (number + 1 > max)
                max = number + 1;
        }
        if (max > 4096) { /* dense tables: Envoy's messages number their fields from 1 up */
            PyErr_Format(PyExc_ValueError, "access_log_schema: field numbers up to %zd in message %zd", max - 1, i);
            Py_DECREF(fields);
            goto fail;
        }
        messages[i].fields = PyMem_Calloc(max ? max : 1, sizeof(field_t));
        if (messages[i].fields == NULL) {
            PyErr_NoMemory();
            Py_DECREF(fields);
            goto fail;
        }
        messages[i].n = max;
        for (Py_ssize_t j = 0; j < nf; j++) {
            PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fields, j), "lll", &number, &kind, &sub);
            messages[i].fields[number] = (field_t){(unsigned char)kind, (unsigned short)sub};
        }
        Py_DECREF(fields);
    }
    Py_DECREF(seq);
    return capsule;
fail:
    Py_DECREF(seq);
    Py_DECREF(capsule);
    return NULL;
}

/* ---- assignment_endpoints: a serialized ClusterLoadAssignment's endpoints, flat (ext_proc/eds_wire.py) ---- */

/* Skips one field of wire type `wire` after its tag; 0 when malformed or a group (declined). */
static int skip_field(ptr *p, ptr end, unsigned wire)
{
    uint64_t v;
    ptr s;
    Py_ssize_t n;
    switch (wire) {
    case 0:
        return varint(p, end, &v);
    case 1:
        if (end - *p < 8)
            return 0;
        *p += 8;
        return 1;
    case 2:
        return delimited(p, end, &s, &n);
    case 5:
        if (end - *p < 4)
            return 0;
        *p += 4;
        return 1;
    default:
        return 0;
    }
}

/* What one LbEndpoint gives: its socket address (host bytes, port, whether port_value is the set
 * member of its oneof), health, weight (0: unset) and metadata bytes (NULL: unset). */
typedef struct {
    ptr host;
    Py_ssize_t host_n;
    uint64_t port;
    int has_port;
    int32_t health;
    uint64_t weight;
    ptr meta;
    Py_ssize_t meta_n;
} eds_endpoint_t;

#define EDS_NEXT()                                                                                             \
    uint32_t field;                                                                                            \
    unsigned wire;                                                                                             \
    ptr s;                                                                                                     \
    Py_ssize_t n;                                                                                              \
    uint64_t v;                                                                                                \
    if (!tag(&p, end, &field, &wire))                                                                          \
        return 0;                                                                                              \
    (void)s;                                                                                                   \
    (void)n;                                                                                                   \
    (void)v

/* A singular message field seen twice is merged by protobuf: declined here. */
#define EDS_ONCE(bit)                                                                                          \
    do {                                                                                                       \
        if (seen & (1u << (bit)))                                                                              \
            return 0;                                                                                          \
        seen |= 1u << (bit);                                                                                   \
    } while (0)

/* SocketAddress: 2 address, 3 port_value (oneof port_specifier with 4 named_port). */
static int eds_socket(ptr p, ptr end, eds_endpoint_t *e)
{
    while (p < end) {
        EDS_NEXT();
        if (field == 2 && wire == 2) {
            if (!delimited(&p, end, &s, &n) || !valid_utf8_fast(s, n))
                return 0;
            e->host = s;
            e->host_n = n;
        } else if (field == 3 && wire == 0) {
            if (!varint(&p, end, &v) || v > 0xFFFFFFFFu)
                return 0;
            e->port = v;
            e->has_port = 1;
        } else if (field == 2 || field == 3 || !skip_field(&p, end, wire)) {
            return 0;
        } else if (field == 4) {
            e->port = 0;
            e->has_port = 0;
        }
    }
    return 1;
}

/* Address: 1 socket_address (oneof address with 2 pipe, 3 envoy_internal_address). */
static int eds_address(ptr p, ptr end, eds_endpoint_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        EDS_NEXT();
        if (field == 1 && wire == 2) {
            EDS_ONCE(0);
            if (!delimited(&p, end, &s, &n) || !eds_socket(s, s + n, e))
                return 0;
        } else if (field == 1 || !skip_field(&p, end, wire)) {
            return 0;
        } else if (field == 2 || field == 3) {
            if (seen)
                return 0; /* a socket address cleared by another member: left to protobuf */
            e->host_n = 0;
        }
    }
    return 1;
}

/* Endpoint: 1 address. */
static int eds_endpoint(ptr p, ptr end, eds_endpoint_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        EDS_NEXT();
        if (field == 1 && wire == 2) {
            EDS_ONCE(0);
            if (!delimited(&p, end, &s, &n) || !eds_address(s, s + n, e))
                return 0;
        } else if (field == 1 || !skip_field(&p, end, wire)) {
            return 0;
        }
    }
    return 1;
}

/* LbEndpoint: 1 endpoint (oneof host_identifier with 5 endpoint_name), 2 health_status, 3 metadata,
 * 4 load_balancing_weight (UInt32Value: 1 value). */
static int eds_lb_endpoint(ptr p, ptr end, eds_endpoint_t *e)
{
    unsigned seen = 0;
    while (p < end) {
        EDS_NEXT();
        if (field == 1 && wire == 2) {
            EDS_ONCE(0);
            if (!delimited(&p, end, &s, &n) || !eds_endpoint(s, s + n, e))
                return 0;
        } else if (field == 2 && wire == 0) {
            if (!varint(&p, end, &v))
                return 0;
            e->health = (int32_t)(uint32_t)v; /* an int32 enum: protobuf keeps the low 32 bits */
        } else if (field == 3 && wire == 2) {
            EDS_ONCE(1);
            if (!delimited(&p, end, &s, &n))
                return 0;
            e->meta = s;
            e->meta_n = n;
        } else if (field == 4 && wire == 2) {
            EDS_ONCE(2);
            if (!delimited(&p, end, &s, &n))
                return 0;
            for (ptr q = s, qend = s + n; q < qend;) {
                uint32_t f2;
                unsigned w2;
                if (!tag(&q, qend, &f2, &w2))
                    return 0;
                if (f2 == 1 && w2 == 0) {
                    if (!varint(&q, qend, &v) || v > 0xFFFFFFFFu)
                        return 0;
                    e->weight = v;
                } else if (f2 == 1 || !skip_field(&q, qend, w2)) {
                    return 0;
                }
            }
        } else if (field <= 4 || !skip_field(&p, end, wire)) {
            return 0;
        } else if (field == 5) {
            if (seen & 1u)
                return 0; /* an endpoint cleared by endpoint_name: left to protobuf */
        }
    }
    return 1;
}

/* The "HOST:PORT" the picker names an endpoint by (an IPv6 host in brackets), or None when it has
 * no host or no port_value (ext_proc.eds_wire.assignment_endpoints_py). */
static PyObject *eds_name(const eds_endpoint_t *e)
{
    if (e->host_n == 0 || (e->port == 0 && !e->has_port))
        Py_RETURN_NONE;
    int colon = memchr(e->host, ':', (size_t)e->host_n) != NULL && e->host[0] != '[';
    char port[16];
    int port_n = snprintf(port, sizeof port, ":%llu", (unsigned long long)e->port);
    Py_ssize_t total = e->host_n + 2 * colon + port_n;
    char stack[512], *buf = total <= (Py_ssize_t)sizeof stack ? stack : PyMem_Malloc((size_t)total);
    if (buf == NULL)
        return PyErr_NoMemory();
    char *q = buf;
    if (colon)
        *q++ = '[';
    memcpy(q, e->host, (size_t)e->host_n);
    q += e->host_n;
    if (colon)
        *q++ = ']';
    memcpy(q, port, (size_t)port_n);
    PyObject *out = PyUnicode_DecodeUTF8(buf, total, "strict");
    if (buf != stack)
        PyMem_Free(buf);
    return out;
}

static PyObject *bytes_or_none(ptr s, Py_ssize_t n)
{
    if (s == NULL)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)s, n);
}

/* LocalityLbEndpoints: 2 lb_endpoints (repeated), 5 priority, 9 metadata. Appends its tuple to out:
 * 1 done, 0 declined, -1 Python error. */
static int eds_locality(ptr p, ptr end, PyObject *out)
{
    uint64_t priority = 0;
    ptr meta = NULL;
    Py_ssize_t meta_n = 0;
    unsigned seen = 0;
    PyObject *names = PyList_New(0), *health = PyList_New(0), *weights = PyList_New(0), *metas = PyList_New(0);
    int rc = -1;
    if (names == NULL || health == NULL || weights == NULL || metas == NULL)
        goto done;
    while (p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        rc = 0;
        if (!tag(&p, end, &field, &wire))
            goto done;
        if (field == 2 && wire == 2) {
            eds_endpoint_t e = {0};
            if (!delimited(&p, end, &s, &n) || !eds_lb_endpoint(s, s + n, &e))
                goto done;
            rc = -1;
            PyObject *items[4] = {eds_name(&e), PyLong_FromLong(e.health), PyLong_FromUnsignedLongLong(e.weight),
                                  bytes_or_none(e.meta, e.meta_n)};
            PyObject *lists[4] = {names, health, weights, metas};
            int failed = 0;
            for (int i = 0; i < 4; i++) {
                failed |= items[i] == NULL || PyList_Append(lists[i], items[i]) < 0;
                Py_XDECREF(items[i]);
            }
            if (failed)
                goto done;
        } else if (field == 5 && wire == 0) {
            if (!varint(&p, end, &priority) || priority > 0xFFFFFFFFu)
                goto done;
        } else if (field == 9 && wire == 2) {
            if (seen || !delimited(&p, end, &meta, &meta_n))
                goto done;
            seen = 1;
        } else if (field == 2 || field == 5 || field == 9 || !skip_field(&p, end, wire)) {
            goto done;
        }
    }
    rc = -1;
    PyObject *m = bytes_or_none(meta, meta_n);
    PyObject *t = m == NULL ? NULL : Py_BuildValue("(KNOOOO)", (unsigned long long)priority, m, names, health,
                                                   weights, metas);
    if (t != NULL) {
        rc = PyList_Append(out, t) < 0 ? -1 : 1;
        Py_DECREF(t);
    }
done:
    if (rc == 0 && PyErr_Occurred())
        rc = -1;
    Py_XDECREF(names);
    Py_XDECREF(health);
    Py_XDECREF(weights);
    Py_XDECREF(metas);
    return rc;
}

/* ClusterLoadAssignment: 2 endpoints (repeated); every other field skipped. */
static PyObject *assignment_endpoints(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ptr p = view.buf, end = p + view.len;
    PyObject *out = PyList_New(0);
    int rc = out == NULL ? -1 : 1;
    while (rc == 1 && p < end) {
        uint32_t field;
        unsigned wire;
        ptr s;
        Py_ssize_t n;
        if (!tag(&p, end, &field, &wire))
            rc = 0;
        else if (field == 2 && wire == 2)
            rc = delimited(&p, end, &s, &n) ? eds_locality(s, s + n, out) : 0;
        else if (field == 2 || !skip_field(&p, end, wire))
            rc = 0;
    }
    PyBuffer_Release(&view);
    if (rc == 1)
        return out;
    Py_XDECREF(out);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- block_keys: the prefix index's chained block keys (ext_proc/prefix_index.py) ---------------- */

/* CRC-32 (ISO-HDLC: reflected polynomial 0xEDB88320, zlib.crc32's) and Adler-32 (RFC 1950,
 * zlib.adler32's): the same values as zlib's for the same bytes and start value. Two ways each, the
 * portable one (a table by slicing-by-8; a scalar loop) and, on x86-64, a vector one: CRC-32 by
 * carry-less multiplication (PCLMULQDQ, when the CPU has it), folding 64 bytes a step as in Intel's
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction" (2009), the folded
 * 16 bytes finished by the table; Adler-32 by SSE2 (16 bytes a step: byte sums by PSADBW, the
 * position-weighted sums by PMADDWD). tests/unit/ext_proc/test_prefix_index.py compares both ways
 * with zlib on random inputs. */
static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xFF];
}

/* The CRC register (no pre- or post-inversion) after n more bytes. */
static uint32_t crc_register(uint32_t c, ptr p, Py_ssize_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF]
            ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF]
            ^ crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
    }
#endif
    while (n-- > 0)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

static uint32_t crc32_portable(uint32_t crc, ptr p, Py_ssize_t n)
{
    return ~crc_register(~crc, p, n);
}

#define ADLER_BASE 65521u
#define ADLER_NMAX 5552 /* the most bytes before the sums can overflow 32 bits (zlib's NMAX) */

static uint32_t adler32_portable(uint32_t adler, ptr p, Py_ssize_t n)
{
    uint32_t s1 = adler & 0xFFFF, s2 = adler >> 16;
    while (n > 0) {
        Py_ssize_t k = n < ADLER_NMAX ? n : ADLER_NMAX;
        n -= k;
        while (k-- > 0) {
            s1 += *p++;
            s2 += s1;
        }
        s1 %= ADLER_BASE;
        s2 %= ADLER_BASE;
    }
    return s2 << 16 | s1;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define BLOCK_SIMD 1
#include <emmintrin.h>
#include <wmmintrin.h>

static int has_pclmul;

/* One 128-bit lane carried forward over the distance of the constants k (its low half times k's
 * low, its high half times k's high), plus the data found there. */
__attribute__((target("pclmul,sse2"))) static inline __m128i crc_fold(__m128i x, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

__attribute__((target("pclmul,sse2"))) static uint32_t crc32_clmul(uint32_t crc, ptr p, Py_ssize_t n)
{
    uint32_t c = ~crc;
    if (n < 64)
        return ~crc_register(c, p, n);
    /* x^(512+32) and x^(512-32) mod P, bit-reflected (64 bytes ahead); x^(128+32), x^(128-32) (16). */
    const __m128i k64 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k16 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i d = _mm_loadu_si128((const __m128i *)(p + 32)), e = _mm_loadu_si128((const __m128i *)(p + 48));
    a = _mm_xor_si128(a, _mm_cvtsi32_si128((int)c)); /* the start register enters as the first 4 bytes */
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        a = crc_fold(a, k64, _mm_loadu_si128((const __m128i *)p));
        b = crc_fold(b, k64, _mm_loadu_si128((const __m128i *)(p + 16)));
        d = crc_fold(d, k64, _mm_loadu_si128((const __m128i *)(p + 32)));
        e = crc_fold(e, k64, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    a = crc_fold(crc_fold(crc_fold(a, k16, b), k16, d), k16, e);
    for (; n >= 16; p += 16, n -= 16)
        a = crc_fold(a, k16, _mm_loadu_si128((const __m128i *)p));
    /* The 16 folded bytes are congruent to all the data so far: their CRC from a zero register is its. */
    unsigned char folded[16];
    _mm_storeu_si128((__m128i *)folded, a);
    return ~crc_register(crc_register(0, folded, 16), p, n);
}

static uint32_t adler32_sse2(uint32_t adler, ptr p, Py_ssize_t n)
{
    uint32_t s1 = adler & 0xFFFF, s2 = adler >> 16;
    const __m128i zero = _mm_setzero_si128();
    const __m128i w_lo = _mm_setr_epi16(16, 15, 14, 13, 12, 11, 10, 9), w_hi = _mm_setr_epi16(8, 7, 6, 5, 4, 3, 2, 1);
    while (n >= 16) {
        Py_ssize_t k = (n < ADLER_NMAX ? n : ADLER_NMAX) & ~(Py_ssize_t)15, steps = k / 16;
        n -= k;
        /* per step: the byte sums (2 lanes), the weighted sums (4 lanes), and the byte sums before it */
        __m128i sums = zero, weighted = zero, before = zero;
        for (; k > 0; k -= 16, p += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            before = _mm_add_epi32(before, sums);
            sums = _mm_add_epi32(sums, _mm_sad_epu8(v, zero));
            weighted = _mm_add_epi32(weighted, _mm_add_epi32(_mm_madd_epi16(_mm_unpacklo_epi8(v, zero), w_lo),
                                                             _mm_madd_epi16(_mm_unpackhi_epi8(v, zero), w_hi)));
        }
        uint32_t a[4], w[4], b[4];
        _mm_storeu_si128((__m128i *)a, sums);
        _mm_storeu_si128((__m128i *)w, weighted);
        _mm_storeu_si128((__m128i *)b, before);
        uint64_t t2 = (uint64_t)s2 + (uint64_t)steps * 16 * s1 + 16 * ((uint64_t)b[0] + b[2])
                      + (uint64_t)w[0] + w[1] + w[2] + w[3];
        s1 = (uint32_t)(((uint64_t)s1 + a[0] + a[2]) % ADLER_BASE);
        s2 = (uint32_t)(t2 % ADLER_BASE);
    }
    return adler32_portable(s2 << 16 | s1, p, n);
}
#endif

/* block_keys(data, block_bytes, max_blocks, simd=True) -> tuple[int, ...]: key i of data's first
 * min(len // block_bytes, max_blocks) full blocks is crc << 32 | adler of blocks 0..i, each continued
 * block by block from zlib's start values (0 and 1): what ext_proc.prefix_index.block_hashes_py
 * gives. simd False: the portable ways only (for the tests). block_bytes >= 1 and max_blocks >= 0
 * (ValueError otherwise). */
/* The chained keys of data's first min(len / size, blocks) blocks of size bytes (a tuple; NULL: error). */
static PyObject *keys_of(ptr p, Py_ssize_t len, Py_ssize_t size, Py_ssize_t blocks, int simd)
{
    uint32_t (*crc)(uint32_t, ptr, Py_ssize_t) = crc32_portable;
    uint32_t (*adler)(uint32_t, ptr, Py_ssize_t) = adler32_portable;
#ifdef BLOCK_SIMD
    if (simd) {
        adler = adler32_sse2;
        if (has_pclmul)
            crc = crc32_clmul;
    }
#else
    (void)simd;
#endif
    if (len / size < blocks)
        blocks = len / size;
    PyObject *out = PyTuple_New(blocks);
    if (out == NULL)
        return NULL;
    uint32_t c = 0, a = 1;
    for (Py_ssize_t i = 0; i < blocks; i++, p += size) {
        c = crc(c, p, size);
        a = adler(a, p, size);
        PyObject *key = PyLong_FromUnsignedLongLong((unsigned long long)c << 32 | a);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, key);
    }
    return out;
}

static PyObject *block_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t size, blocks;
    int simd = 1;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "block_keys(data, block_bytes, max_blocks, simd=True)");
        return NULL;
    }
    size = PyLong_AsSsize_t(args[1]);
    blocks = PyLong_AsSsize_t(args[2]);
    if ((size == -1 || blocks == -1) && PyErr_Occurred())
        return NULL;
    if (size < 1 || blocks < 0) {
        PyErr_Format(PyExc_ValueError, "block_bytes must be >= 1 and max_blocks >= 0, got %zd and %zd", size, blocks);
        return NULL;
    }
    if (nargs == 4 && (simd = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = keys_of(view.buf, view.len, size, blocks, simd);
    PyBuffer_Release(&view);
    return out;
}

/* ---- prompt_keys: a chat body's canonical prompt bytes, their block keys, prefix bytes and characters
 * (ext_proc/prefix_index.py: prompt_keys_py is the reference). */

/* The keys read (interned at import). */
static PyObject *s_messages, *s_role, *s_content, *s_text;

/* One piece of the canonical bytes: a string's UTF-8, or one separator byte. */
typedef struct { const char *s; Py_ssize_t n; } piece_t;

typedef struct {
    piece_t *pieces;
    Py_ssize_t count, cap, bytes;
    int ascii; /* every string piece is ASCII */
} pieces_t;

/* 1: added; 0: decline (a lone surrogate: UTF-8 with surrogatepass is the reference's); -1: error. */
static int add_piece(pieces_t *ps, const char *s, Py_ssize_t n)
{
    if (ps->count == ps->cap) {
        Py_ssize_t cap = ps->cap ? ps->cap * 2 : 64;
        piece_t *grown = PyMem_Realloc(ps->pieces, (size_t)cap * sizeof(piece_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ps->pieces = grown;
        ps->cap = cap;
    }
    ps->pieces[ps->count].s = s;
    ps->pieces[ps->count].n = n;
    ps->count++;
    ps->bytes += n;
    return 1;
}

static int add_text(pieces_t *ps, PyObject *text)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n); /* kept by the str: valid while the doc lives */
    if (s == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (!PyUnicode_IS_ASCII(text))
        ps->ascii = 0;
    return add_piece(ps, s, n);
}

/* A message's content as message_text reads it: its pieces and characters. 1 / 0 (decline) / -1. */
static int add_content(pieces_t *ps, PyObject *content, Py_ssize_t *chars)
{
    if (PyUnicode_CheckExact(content)) {
        *chars += PyUnicode_GET_LENGTH(content);
        return add_text(ps, content);
    }
    if (PyUnicode_Check(content) || (PyList_Check(content) && !PyList_CheckExact(content)))
        return 0;
    if (!PyList_CheckExact(content))
        return 1; /* neither a string nor a list: no text */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(content); i++) {
        PyObject *part = PyList_GET_ITEM(content, i);
        if (!PyDict_Check(part))
            continue;
        if (!PyDict_CheckExact(part))
            return 0;
        PyObject *text = PyDict_GetItemWithError(part, s_text);
        if (text == NULL) {
            if (PyErr_Occurred())
                return -1;
            continue;
        }
        if (!PyUnicode_Check(text))
            continue;
        if (!PyUnicode_CheckExact(text))
            return 0;
        *chars += PyUnicode_GET_LENGTH(text);
        int rc = add_text(ps, text);
        if (rc != 1)
            return rc;
    }
    return 1;
}

static const char SEPARATORS[2] = {'\x1f', '\x1e'};

static PyObject *prompt_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "prompt_keys(doc, prefix_messages, prefix_max_bytes, block_bytes, max_blocks)");
        return NULL;
    }
    Py_ssize_t prefix_messages = PyLong_AsSsize_t(args[1]), max_bytes = PyLong_AsSsize_t(args[2]);
    Py_ssize_t size = PyLong_AsSsize_t(args[3]), blocks = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (size < 1 || blocks < 0) {
        PyErr_Format(PyExc_ValueError, "block_bytes must be >= 1 and max_blocks >= 0, got %zd and %zd", size, blocks);
        return NULL;
    }
    PyObject *doc = args[0];
    if (!PyDict_CheckExact(doc) || max_bytes < 0)
        Py_RETURN_NONE;
    PyObject *chat = PyDict_GetItemWithError(doc, s_messages);
    if (chat == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE; /* no messages: a completion's prompt, or none (the reference reads it) */
    }
    if (!PyList_CheckExact(chat))
        Py_RETURN_NONE;
    pieces_t ps = {NULL, 0, 0, 0, 1};
    Py_ssize_t chars = 0, lead = 0;
    int leading = 0, rc = 1;
    Py_INCREF(chat); /* the list and its items stay while we read them (a str's UTF-8 lives with it) */
    for (Py_ssize_t i = 0; rc == 1 && i < PyList_GET_SIZE(chat); i++) {
        PyObject *m = PyList_GET_ITEM(chat, i);
        if (!PyDict_Check(m))
            continue;
        if (!PyDict_CheckExact(m)) {
            rc = 0;
            break;
        }
        Py_ssize_t before_chars = chars;
        PyObject *role = PyDict_GetItemWithError(m, s_role);
        if (role == NULL && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        Py_ssize_t role_chars = 0;
        if (role != NULL && PyUnicode_Check(role)) {
            if (!PyUnicode_CheckExact(role)) {
                rc = 0;
                break;
            }
            role_chars = PyUnicode_GET_LENGTH(role);
            rc = add_text(&ps, role);
            if (rc != 1)
                break;
        }
        rc = add_piece(&ps, SEPARATORS, 1);
        if (rc != 1)
            break;
        PyObject *content = PyDict_GetItemWithError(m, s_content);
        if (content == NULL && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        if (content != NULL) {
            rc = add_content(&ps, content, &chars);
            if (rc != 1)
                break;
        }
        rc = add_piece(&ps, SEPARATORS + 1, 1);
        if (rc != 1)
            break;
        if (i < prefix_messages) {
            lead += role_chars + (chars - before_chars) + 2;
            leading = 1;
        }
    }
    PyObject *result = NULL;
    char *data = NULL;
    if (rc == 1) {
        data = PyMem_Malloc(ps.bytes ? (size_t)ps.bytes : 1);
        if (data == NULL) {
            PyErr_NoMemory();
            rc = -1;
        }
    }
    if (rc == 1) {
        char *w = data;
        for (Py_ssize_t k = 0; k < ps.count; k++) {
            memcpy(w, ps.pieces[k].s, (size_t)ps.pieces[k].n);
            w += ps.pieces[k].n;
        }
        PyObject *keys = keys_of((ptr)data, ps.bytes, size, blocks, 1), *prefix = NULL, *count = NULL;
        if (keys != NULL && leading) {
            Py_ssize_t cut = lead < max_bytes ? lead : max_bytes, end = cut; /* characters */
            if (!ps.ascii) { /* the byte where character cut starts (UTF-8: count the lead bytes) */
                Py_ssize_t seen = 0;
                for (end = 0; end < ps.bytes; end++)
                    if (((unsigned char)data[end] & 0xC0) != 0x80 && seen++ == cut)
                        break;
            }
            if (end > max_bytes)
                end = max_bytes;
            prefix = PyBytes_FromStringAndSize(data, end);
        } else if (keys != NULL) {
            prefix = Py_NewRef(Py_None);
        }
        if (prefix != NULL)
            count = PyLong_FromSsize_t(chars);
        if (count != NULL)
            result = PyTuple_Pack(3, keys, prefix, count);
        Py_XDECREF(keys);
        Py_XDECREF(prefix);
        Py_XDECREF(count);
    } else if (rc == 0) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(data);
    PyMem_Free(ps.pieces);
    Py_DECREF(chat);
    return result;
}

/* ---- engine_keys: a prompt's KV block keys as the llm simulator computes them (ext_proc/engine_keys.py) */

/* CPython's hash of an int that fits in 64 bits (signed): its absolute value modulo 2**61 - 1 with
 * its sign, -1 made -2 (Objects/longobject.c). */
static int64_t py_int_hash(int64_t v)
{
    const uint64_t modulus = ((uint64_t)1 << 61) - 1;
    uint64_t a = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int64_t h = (int64_t)(a % modulus);
    if (v < 0)
        h = -h;
    return h == -1 ? -2 : h;
}

/* CPython 3.8+'s tuple hash (Objects/tupleobject.c, xxHash's round) over lanes already hashed. */
#define XXPRIME_1 11400714785074694791ULL
#define XXPRIME_2 14029467366897019727ULL
#define XXPRIME_5 2870177450012600261ULL
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))

static int64_t py_tuple_hash(const int64_t *lanes, Py_ssize_t n)
{
    uint64_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < n; i++) {
        acc += (uint64_t)lanes[i] * XXPRIME_2;
        acc = XXROTATE(acc);
        acc *= XXPRIME_1;
    }
    acc += (uint64_t)n ^ (XXPRIME_5 ^ 3527539ULL);
    return acc == (uint64_t)-1 ? 1546275796 : (int64_t)acc;
}

/* engine_keys(text, bytes_per_token, vocab, block_size) -> tuple[int, ...]: the token ids of UTF-8
 * text (each bytes_per_token bytes: the CRC-32 of them modulo vocab, the last may be shorter) in full
 * blocks of block_size, key i = hash((key i-1, block i's ids as a tuple)) as CPython computes it,
 * key -1 = 0: what ext_proc.engine_keys.engine_keys_py gives. All three sizes >= 1 and vocab below
 * 2**32 (ValueError otherwise). */
static PyObject *engine_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "engine_keys(text, bytes_per_token, vocab, block_size)");
        return NULL;
    }
    Py_ssize_t per = PyLong_AsSsize_t(args[1]), vocab = PyLong_AsSsize_t(args[2]), size = PyLong_AsSsize_t(args[3]);
    if ((per == -1 || vocab == -1 || size == -1) && PyErr_Occurred())
        return NULL;
    if (per < 1 || vocab < 1 || size < 1 || size > 1 << 20 || (uint64_t)vocab > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "bytes_per_token, vocab and block_size must be >= 1 (block_size <= 2**20, "
                     "vocab < 2**32), got %zd, %zd and %zd", per, vocab, size);
        return NULL;
    }
    /* a % vocab by two multiplications (Lemire, Kaser and Kurz, "Faster remainder by direct
     * computation", 2019: exact for 32-bit a and vocab), not a division per token */
    const uint64_t v32 = (uint64_t)vocab, inverse = UINT64_MAX / v32 + 1;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t tokens = (view.len + per - 1) / per, blocks = tokens / size;
    PyObject *out = PyTuple_New(blocks);
    int64_t *ids = blocks ? PyMem_Malloc((size_t)(blocks * size + blocks) * sizeof(int64_t)) : NULL;
    if (out != NULL && blocks && ids == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
    }
    if (out != NULL) {
        /* The blocks' token ids, then each block's tuple hash (four blocks at a time: each hash is a
         * chain of dependent multiplications, so four chains side by side keep the multiplier busy),
         * then the keys' chain. */
        int64_t *inner = blocks ? ids + blocks * size : NULL;
        ptr p = view.buf, end = p + view.len;
        for (Py_ssize_t t = 0; t < blocks * size; t++, p += per) {
            Py_ssize_t n = end - p < per ? end - p : per;
            uint32_t c;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            if (n == 4) { /* the usual token: its 4 bytes' table reads independent of each other */
                uint32_t w;
                memcpy(&w, p, 4);
                w = ~w;
                c = crc_table[3][w & 0xFF] ^ crc_table[2][(w >> 8) & 0xFF] ^ crc_table[1][(w >> 16) & 0xFF]
                    ^ crc_table[0][w >> 24];
            } else
#endif
                c = crc_register(0xFFFFFFFFu, p, n);
#ifdef __SIZEOF_INT128__
            ids[t] = (int64_t)(uint64_t)(((unsigned __int128)(inverse * (uint64_t)(uint32_t)~c) * v32) >> 64);
#else
            ids[t] = (int64_t)((uint32_t)~c % v32);
            (void)inverse;
#endif
        }
        Py_ssize_t b = 0;
        for (; b + 4 <= blocks; b += 4) {
            uint64_t acc[4] = {XXPRIME_5, XXPRIME_5, XXPRIME_5, XXPRIME_5};
            for (Py_ssize_t t = 0; t < size; t++)
                for (int k = 0; k < 4; k++) {
                    acc[k] += (uint64_t)ids[(b + k) * size + t] * XXPRIME_2;
                    acc[k] = XXROTATE(acc[k]);
                    acc[k] *= XXPRIME_1;
                }
            for (int k = 0; k < 4; k++) {
                acc[k] += (uint64_t)size ^ (XXPRIME_5 ^ 3527539ULL);
                inner[b + k] = acc[k] == (uint64_t)-1 ? 1546275796 : (int64_t)acc[k];
            }
        }
        for (; b < blocks; b++)
            inner[b] = py_tuple_hash(ids + b * size, size);
        int64_t prev = 0;
        for (b = 0; b < blocks; b++) {
            int64_t pair[2] = {py_int_hash(prev), inner[b]};
            prev = py_tuple_hash(pair, 2);
            PyObject *key = PyLong_FromLongLong(prev);
            if (key == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyTuple_SET_ITEM(out, b, key);
        }
    }
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"request_headers", request_headers, METH_O,
     "request_headers(data) -> (headers, end_of_stream) | None: see ext_proc.wire."},
    {"request_body", request_body, METH_O,
     "request_body(data) -> (body, end_of_stream) | None: see ext_proc.wire."},
    {"access_log", (PyCFunction)(void (*)(void))access_log, METH_FASTCALL,
     "access_log(schema, data, cluster_header, override_host_header) -> list[tuple] | None: see ext_proc.wire."},
    {"access_log_schema", access_log_schema, METH_O,
     "access_log_schema(messages) -> the schema access_log checks messages with: see ext_proc.wire."},
    {"assignment_endpoints", assignment_endpoints, METH_O,
     "assignment_endpoints(data) -> list[tuple] | None: see ext_proc.eds_wire."},
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL,
     "block_keys(data, block_bytes, max_blocks, simd=True) -> tuple[int, ...]: see ext_proc.prefix_index."},
    {"prompt_keys", (PyCFunction)(void (*)(void))prompt_keys, METH_FASTCALL,
     "prompt_keys(doc, prefix_messages, prefix_max_bytes, block_bytes, max_blocks) -> (keys, prefix, chars) | None: "
     "see ext_proc.prefix_index."},
    {"engine_keys", (PyCFunction)(void (*)(void))engine_keys, METH_FASTCALL,
     "engine_keys(text, bytes_per_token, vocab, block_size) -> tuple[int, ...]: see ext_proc.engine_keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ext_proc._wire", "The compiled decoders of the picker's hot messages (see ext_proc.wire).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__wire(void)
{
    PyObject *m = PyModule_Create(&module), *names = NULL, *fields = NULL;
    if (m == NULL)
        return NULL;
    crc_init();
    s_messages = PyUnicode_InternFromString("messages");
    s_role = PyUnicode_InternFromString("role");
    s_content = PyUnicode_InternFromString("content");
    s_text = PyUnicode_InternFromString("text");
    if (s_messages == NULL || s_role == NULL || s_content == NULL || s_text == NULL)
        goto fail;
#ifdef BLOCK_SIMD
    __builtin_cpu_init();
    has_pclmul = __builtin_cpu_supports("pclmul");
#endif
    names = PyTuple_New(M_READ);
    fields = PyDict_New();
    if (names == NULL || fields == NULL)
        goto fail;
    for (int i = 0; i < M_READ; i++) {
        PyObject *name = PyUnicode_FromString(read_messages[i]);
        if (name == NULL)
            goto fail;
        PyTuple_SET_ITEM(names, i, name);
    }
    for (size_t i = 0; i < sizeof read_fields / sizeof read_fields[0]; i++) {
        PyObject *number = PyLong_FromLong(read_fields[i].number);
        PyObject *key = PyUnicode_FromFormat("%s.%s", read_messages[read_fields[i].message], read_fields[i].name);
        int rc = number == NULL || key == NULL ? -1 : PyDict_SetItem(fields, key, number);
        Py_XDECREF(number);
        Py_XDECREF(key);
        if (rc < 0)
            goto fail;
    }
    if (PyModule_AddObject(m, "ACCESS_LOG_MESSAGES", names) < 0)
        goto fail;
    names = NULL;
    if (PyModule_AddObject(m, "ACCESS_LOG_FIELDS", fields) < 0)
        goto fail;
    fields = NULL;
    if (PyModule_AddIntConstant(m, "K_VARINT", K_VARINT) < 0 || PyModule_AddIntConstant(m, "K_FIXED64", K_FIXED64) < 0
        || PyModule_AddIntConstant(m, "K_FIXED32", K_FIXED32) < 0 || PyModule_AddIntConstant(m, "K_BYTES", K_BYTES) < 0
        || PyModule_AddIntConstant(m, "K_STRING", K_STRING) < 0 || PyModule_AddIntConstant(m, "K_MESSAGE", K_MESSAGE) < 0
        || PyModule_AddIntConstant(m, "K_DECLINE", K_DECLINE) < 0)
        goto fail;
    return m;
fail:
    Py_XDECREF(names);
    Py_XDECREF(fields);
    Py_DECREF(m);
    return NULL;
}
