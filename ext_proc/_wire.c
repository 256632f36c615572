/* ext_proc._wire: the compiled request-headers decoder (see ext_proc/wire.py, the reference).
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef const unsigned char *ptr;

/* A varint of at most 10 bytes whose value fits 64 bits; 0 when malformed. */
static int varint(ptr *p, ptr end, uint64_t *out)
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

/* A tag: field number (1 .. 2^29-1) and wire type; 0 when malformed. */
static int tag(ptr *p, ptr end, uint32_t *field, unsigned *wire)
{
    uint64_t t;
    if (!varint(p, end, &t) || t > 0xFFFFFFFFu || (t >> 3) == 0)
        return 0;
    *field = (uint32_t)(t >> 3);
    *wire = (unsigned)(t & 7);
    return 1;
}

/* A length-delimited payload: [*start, *start + *len) within end; 0 when malformed. */
static int delimited(ptr *p, ptr end, ptr *start, Py_ssize_t *len)
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

static PyMethodDef methods[] = {
    {"request_headers", request_headers, METH_O,
     "request_headers(data) -> (headers, end_of_stream) | None: see ext_proc.wire."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ext_proc._wire", "The compiled request-headers decoder (see ext_proc.wire).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
