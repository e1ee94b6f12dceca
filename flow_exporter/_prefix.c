/*
 * A connection's record prefix, compiled (issue 24), part of flow_exporter._native.
 *
 *   encode_prefix(export, context) -> bytes or NotImplemented
 *     The connection-lifetime part of a FlowRecord (connectionId .. reporter) for an Export whose prefix is
 *     not cached, exactly as sink.encoder.RecordEncoder.static encodes it: the addresses as text, the source
 *     NAT fields, the ICMP fields, the Kubernetes metadata, the Community ID. `context` is the encoder's
 *     (node_fields: bytes, node: str, seed: int, sha1: callable, k8s_fields: tuple of str).
 *
 * Why compiled: on a node with churn nearly every record is its connection's first, and the pure prefix cost
 * about 9 us of the GIL per record (a profile of 20,000 new connections/s: 15% of the process's GIL time).
 *
 * Anything this code cannot encode exactly as the pure encoder would (an integer out of range, a value of an
 * unexpected type, a string that is not valid UTF-8, a non-dict map) returns NotImplemented before anything
 * is written, and the caller runs the pure encoder, which gives the bytes or raises exactly as it always did.
 * The SHA-1 of the Community ID is hashlib's (the `sha1` of the context), not a hand-written one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#include "_records.h"

#define PROTO_ICMP 1
#define PROTO_TCP 6
#define PROTO_UDP 17
#define PROTO_ICMPV6 58
#define PROTO_SCTP 132

/* The Export and Connection fields read here. */
enum { E_FLOW_ID, E_FIRST, E_FLAGS, E_META, E_CONN, E_N };
static const char *const ENAMES[E_N] = {"flow_id", "first_seen_ns", "flags", "meta", "conn"};
enum {
    C_FAMILY, C_PROTO, C_OSRC, C_ODST, C_OSPORT, C_ODPORT, C_RSRC, C_RDST, C_RSPORT, C_RDPORT, C_ZONE, C_CT_ID,
    C_MARK, C_LABELS, C_ICMP_TYPE, C_ICMP_CODE, C_N
};
static const char *const CNAMES[C_N] = {
    "family", "proto", "orig_src", "orig_dst", "orig_sport", "orig_dport", "reply_src", "reply_dst",
    "reply_sport", "reply_dport", "zone", "ct_id", "mark", "labels", "icmp_type", "icmp_code"};

static SlotCache e_bound, c_bound;

static int bound(SlotCache *c, PyObject *o, const char *const *names, int n) {
    return slot_cache(c, (PyObject *)Py_TYPE(o), names, n);
}

#define FIELD(b, o, i) SLOT_AT(b, o, i)

/* A growable output buffer. */
typedef struct {
    uint8_t *p;
    Py_ssize_t len, cap;
    uint8_t local[1024];
} Out;

static int room(Out *o, Py_ssize_t more) {
    if (o->len + more <= o->cap) return 0;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + more) cap *= 2;
    uint8_t *p = PyMem_Malloc(cap);
    if (p == NULL) {
        PyErr_NoMemory(); /* ERR means an exception is set: without one the call ends in a SystemError */
        return -1;
    }
    memcpy(p, o->p, o->len);
    if (o->p != o->local) PyMem_Free(o->p);
    o->p = p;
    o->cap = cap;
    return 0;
}

static int put(Out *o, const void *data, Py_ssize_t n) {
    if (room(o, n)) return -1;
    memcpy(o->p + o->len, data, n);
    o->len += n;
    return 0;
}

static int put_byte(Out *o, uint8_t v) { return put(o, &v, 1); }

static int put_long(Out *o, int64_t n) {
    uint8_t b[10];
    return put(o, b, avro_long(b, n));
}

/* Avro string from UTF-8 bytes. */
static int put_string(Out *o, const char *s, Py_ssize_t n) { return put_long(o, n) || put(o, s, n); }

/* Outcomes of a field: written, or not this code's to encode (NotImplemented), or an error (memory). */
#define OK 0
#define PURE 1
#define ERR -1

/* An int within [lo, hi]: OK, else PURE (no error left set). */
static int int_in(PyObject *v, int64_t lo, int64_t hi, int64_t *out) {
    if (v == NULL || !PyLong_Check(v)) return PURE;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return PURE;
    }
    if (x < lo || x > hi) return PURE;
    *out = (int64_t)x;
    return OK;
}

static int long_of(Out *o, PyObject *v) {
    int64_t x;
    if (int_in(v, INT64_MIN, INT64_MAX, &x)) return PURE;
    return put_long(o, x) ? ERR : OK;
}

static int u16_of(Out *o, PyObject *v) {
    int64_t x;
    if (int_in(v, 0, 0xFFFF, &x)) return PURE;
    return put_long(o, x) ? ERR : OK;
}

/* An exact str as an Avro string; PURE for anything else, or a str that is not valid UTF-8. */
static int str_of(Out *o, PyObject *v) {
    if (!PyUnicode_CheckExact(v)) return PURE;
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(v, &n);
    if (s == NULL) {
        PyErr_Clear();
        return PURE;
    }
    return put_string(o, s, n) ? ERR : OK;
}

static int opt_str_of(Out *o, PyObject *v) {
    if (v == NULL || v == Py_None) return put_byte(o, 0) ? ERR : OK;
    if (put_byte(o, 2)) return ERR;
    return str_of(o, v);
}

/* An optional map of strings: None, or an exact dict of exact str to exact str. */
static int opt_map_of(Out *o, PyObject *v) {
    if (v == NULL || v == Py_None) return put_byte(o, 0) ? ERR : OK;
    if (!PyDict_CheckExact(v)) return PURE;
    if (put_byte(o, 2)) return ERR;
    Py_ssize_t n = PyDict_GET_SIZE(v);
    if (n == 0) return put_byte(o, 0) ? ERR : OK;
    if (put_long(o, n)) return ERR;
    Py_ssize_t pos = 0;
    PyObject *k, *val;
    while (PyDict_Next(v, &pos, &k, &val)) {
        int r = str_of(o, k);
        if (r == OK) r = str_of(o, val);
        if (r != OK) return r;
    }
    return put_byte(o, 0) ? ERR : OK;
}

/* A packed address as text, as socket.inet_ntop gives it; PURE unless exact bytes of the family's length. */
static int address_of(Out *o, int family, PyObject *v) {
    Py_ssize_t want = family == AF_INET ? 4 : 16;
    if (!PyBytes_CheckExact(v) || PyBytes_GET_SIZE(v) != want) return PURE;
    char text[INET6_ADDRSTRLEN];
    if (inet_ntop(family, PyBytes_AS_STRING(v), text, sizeof text) == NULL) return PURE;
    return put_string(o, text, (Py_ssize_t)strlen(text)) ? ERR : OK;
}

/* The request/response pairs of ICMP types (community_id._ICMP_PAIRS, _ICMPV6_PAIRS); -1 if unpaired. */
static int icmp_pair(int proto, int64_t type) {
    static const int v4[][2] = {{8, 0}, {0, 8}, {13, 14}, {14, 13}, {15, 16}, {16, 15}, {10, 9}, {9, 10}, {17, 18}, {18, 17}};
    static const int v6[][2] = {{128, 129}, {129, 128}, {130, 131}, {131, 130}, {133, 134}, {134, 133},
                                {135, 136}, {136, 135}, {139, 140}, {140, 139}, {144, 145}, {145, 144}};
    const int(*t)[2] = proto == PROTO_ICMP ? v4 : v6;
    int n = proto == PROTO_ICMP ? (int)(sizeof v4 / sizeof v4[0]) : (int)(sizeof v6 / sizeof v6[0]);
    for (int i = 0; i < n; i++)
        if (t[i][0] == type) return t[i][1];
    return -1;
}

/* Python's ordering of two bytes objects: memcmp over the shorter, then the shorter first. */
static int bytes_cmp(const uint8_t *a, Py_ssize_t la, const uint8_t *b, Py_ssize_t lb) {
    int c = memcmp(a, b, (size_t)(la < lb ? la : lb));
    if (c) return c;
    return la < lb ? -1 : la > lb;
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* community_id.community_id(proto, saddr, daddr, sport, dport, seed) as an Avro string. `sport`/`dport` < 0:
 * None. Addresses are checked already (same family, so the same length). */
static int community_id_of(Out *o, PyObject *sha1, int64_t seed, int64_t proto, PyObject *saddr, PyObject *daddr,
                           int64_t sport, int64_t dport) {
    int one_way = 0;
    if ((proto == PROTO_ICMP || proto == PROTO_ICMPV6) && sport >= 0) {
        int paired = icmp_pair((int)proto, sport);
        if (paired < 0) one_way = 1;
        else dport = paired;
    } else if (proto != PROTO_TCP && proto != PROTO_UDP && proto != PROTO_SCTP) {
        sport = dport = -1;
    }
    const uint8_t *s = (const uint8_t *)PyBytes_AS_STRING(saddr), *d = (const uint8_t *)PyBytes_AS_STRING(daddr);
    Py_ssize_t ls = PyBytes_GET_SIZE(saddr), ld = PyBytes_GET_SIZE(daddr);
    if (!one_way) {
        int c = bytes_cmp(d, ld, s, ls);
        int64_t dp = dport < 0 ? 0 : dport, sp = sport < 0 ? 0 : sport;
        if (c < 0 || (c == 0 && dp < sp)) {
            const uint8_t *t = s;
            s = d;
            d = t;
            Py_ssize_t lt = ls;
            ls = ld;
            ld = lt;
            int64_t pt = sport;
            sport = dport;
            dport = pt;
        }
    }
    uint8_t data[2 + 16 + 16 + 2 + 4];
    Py_ssize_t n = 0;
    data[n++] = (uint8_t)(seed >> 8);
    data[n++] = (uint8_t)seed;
    memcpy(data + n, s, ls);
    n += ls;
    memcpy(data + n, d, ld);
    n += ld;
    data[n++] = (uint8_t)proto;
    data[n++] = 0;
    if (sport >= 0 && dport >= 0) {
        data[n++] = (uint8_t)(sport >> 8);
        data[n++] = (uint8_t)sport;
        data[n++] = (uint8_t)(dport >> 8);
        data[n++] = (uint8_t)dport;
    }
    PyObject *arg = PyBytes_FromStringAndSize((const char *)data, n);
    if (arg == NULL) return ERR;
    PyObject *h = PyObject_CallOneArg(sha1, arg);
    Py_DECREF(arg);
    if (h == NULL) return ERR;
    PyObject *digest = PyObject_CallMethod(h, "digest", NULL);
    Py_DECREF(h);
    if (digest == NULL) return ERR;
    if (!PyBytes_CheckExact(digest) || PyBytes_GET_SIZE(digest) != 20) {
        Py_DECREF(digest);
        return PURE;
    }
    const uint8_t *g = (const uint8_t *)PyBytes_AS_STRING(digest);
    char text[2 + 28];
    text[0] = '1';
    text[1] = ':';
    char *t = text + 2;
    for (int i = 0; i < 21; i += 3) {
        uint32_t v = (uint32_t)g[i] << 16 | (i + 1 < 20 ? (uint32_t)g[i + 1] << 8 : 0) | (i + 2 < 20 ? g[i + 2] : 0);
        *t++ = B64[(v >> 18) & 63];
        *t++ = B64[(v >> 12) & 63];
        *t++ = i + 1 < 20 ? B64[(v >> 6) & 63] : '=';
        *t++ = i + 2 < 20 ? B64[v & 63] : '=';
    }
    Py_DECREF(digest);
    return put_string(o, text, sizeof text) ? ERR : OK;
}

/* An optional small int: None (-1) or within [0, 0xFFFF]. */
static int opt_u16(PyObject *v, int64_t *out) {
    if (v == Py_None) {
        *out = -1;
        return OK;
    }
    return int_in(v, 0, 0xFFFF, out);
}

/* The node's name against a metadata value: 1 equal, 0 not (None or another str), PURE for any other type. */
static int same_node(PyObject *node, PyObject *v) {
    if (v == NULL || v == Py_None) return 0;
    if (!PyUnicode_CheckExact(v)) return -1;
    return PyUnicode_Compare(v, node) == 0;
}

#define TRY(x)                  \
    do {                        \
        int r_ = (x);           \
        if (r_ != OK) return r_; \
    } while (0)

static int encode(Out *o, PyObject *e, PyObject *ctx) {
    PyObject *node_fields = PyTuple_GET_ITEM(ctx, 0), *node = PyTuple_GET_ITEM(ctx, 1);
    PyObject *sha1 = PyTuple_GET_ITEM(ctx, 3), *k8s = PyTuple_GET_ITEM(ctx, 4);
    int64_t seed;
    TRY(int_in(PyTuple_GET_ITEM(ctx, 2), 0, 0xFFFF, &seed));
    if (!PyBytes_CheckExact(node_fields) || !PyUnicode_CheckExact(node) || !PyTuple_CheckExact(k8s)) return PURE;
    int r = bound(&e_bound, e, ENAMES, E_N);
    if (r <= 0) return r < 0 ? ERR : PURE;
    PyObject *c = FIELD(e_bound, e, E_CONN);
    if (c == NULL || c == Py_None) return PURE;
    r = bound(&c_bound, c, CNAMES, C_N);
    if (r <= 0) return r < 0 ? ERR : PURE;
    PyObject *f[C_N];
    for (int i = 0; i < C_N; i++) {
        f[i] = FIELD(c_bound, c, i);
        if (f[i] == NULL) return PURE;
    }
    int64_t fam, proto, first;
    TRY(int_in(f[C_FAMILY], 0, INT64_MAX, &fam));
    if (fam != AF_INET && fam != AF_INET6) return PURE;
    TRY(int_in(f[C_PROTO], 0, 0xFF, &proto)); /* the Community ID takes it as one byte */
    int icmp = proto == PROTO_ICMP || proto == PROTO_ICMPV6;
    int64_t icmp_type = -1, icmp_code = -1;
    if (icmp) {
        TRY(opt_u16(f[C_ICMP_TYPE], &icmp_type));
        TRY(opt_u16(f[C_ICMP_CODE], &icmp_code));
    }
    PyObject *meta = FIELD(e_bound, e, E_META);
    if (meta == NULL) return PURE;
    int has_meta = 0;
    if (meta != Py_None) {
        if (!PyDict_CheckExact(meta)) return PURE;
        has_meta = PyDict_GET_SIZE(meta) > 0;
    }

    TRY(long_of(o, FIELD(e_bound, e, E_FLOW_ID)));
    if (put(o, PyBytes_AS_STRING(node_fields), PyBytes_GET_SIZE(node_fields))) return ERR;
    TRY(int_in(FIELD(e_bound, e, E_FIRST), INT64_MIN, INT64_MAX, &first));
    int64_t ms = first / 1000000;
    if (first % 1000000 != 0 && first < 0) ms -= 1; /* floor division */
    if (put_long(o, ms) || put_byte(o, fam == AF_INET ? 8 : 12) || put_long(o, proto)) return ERR;
    TRY(address_of(o, (int)fam, f[C_OSRC]));
    TRY(u16_of(o, f[C_OSPORT]));
    TRY(address_of(o, (int)fam, f[C_RSRC]));
    TRY(u16_of(o, f[icmp ? C_ODPORT : C_RSPORT]));
    TRY(address_of(o, (int)fam, f[C_ODST]));
    TRY(u16_of(o, f[C_ODPORT]));
    /* translatedSourceAddress, translatedSourcePort: the reply's destination, when it is not the source */
    PyObject *rdst = f[C_RDST], *osrc = f[C_OSRC];
    if (!PyBytes_CheckExact(rdst)) return PURE;
    int same_addr = PyBytes_GET_SIZE(rdst) == PyBytes_GET_SIZE(osrc) &&
                    memcmp(PyBytes_AS_STRING(rdst), PyBytes_AS_STRING(osrc), PyBytes_GET_SIZE(osrc)) == 0;
    int64_t rdport = 0, osport = 0;
    if (!icmp) {
        TRY(int_in(f[C_RDPORT], 0, 0xFFFF, &rdport));
        TRY(int_in(f[C_OSPORT], 0, 0xFFFF, &osport));
    }
    if (same_addr && (icmp || rdport == osport)) {
        if (put_byte(o, 0) || put_byte(o, 0)) return ERR;
    } else {
        if (put_byte(o, 2)) return ERR;
        TRY(address_of(o, (int)fam, rdst));
        if (icmp) {
            if (put_byte(o, 0)) return ERR;
        } else if (put_byte(o, 2) || put_long(o, rdport)) {
            return ERR;
        }
    }
    for (int i = 0; i < 2; i++) {
        int64_t v = i == 0 ? icmp_type : icmp_code;
        if (!icmp || v < 0) {
            if (put_byte(o, 0)) return ERR;
        } else if (put_byte(o, 2) || put_long(o, v)) {
            return ERR;
        }
    }
    TRY(u16_of(o, f[C_ZONE]));
    TRY(long_of(o, f[C_CT_ID]));
    TRY(long_of(o, f[C_MARK]));
    PyObject *labels = f[C_LABELS];
    if (labels == Py_None) {
        if (put_byte(o, 0)) return ERR;
    } else {
        if (!PyBytes_CheckExact(labels)) return PURE;
        if (put_byte(o, 2) || put_long(o, PyBytes_GET_SIZE(labels)) ||
            put(o, PyBytes_AS_STRING(labels), PyBytes_GET_SIZE(labels)))
            return ERR;
    }
    /* the Kubernetes fields: all null and flowType 0 without metadata */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(k8s); i++) {
        PyObject *field = PyTuple_GET_ITEM(k8s, i);
        if (!PyTuple_CheckExact(field) || PyTuple_GET_SIZE(field) != 2) return PURE;
        PyObject *v = NULL;
        if (has_meta) {
            v = PyDict_GetItemWithError(meta, PyTuple_GET_ITEM(field, 0));
            if (v == NULL && PyErr_Occurred()) return ERR;
        }
        TRY(PyTuple_GET_ITEM(field, 1) == Py_True ? opt_map_of(o, v) : opt_str_of(o, v));
    }
    if (has_meta) {
        PyObject *flow_type = PyDict_GetItemWithError(meta, PyTuple_GET_ITEM(ctx, 5));
        if (flow_type == NULL && PyErr_Occurred()) return ERR;
        if (flow_type == NULL) {
            if (put_byte(o, 0)) return ERR;
        } else {
            TRY(long_of(o, flow_type));
        }
    } else if (put_byte(o, 0)) {
        return ERR;
    }
    TRY(long_of(o, FIELD(e_bound, e, E_FLAGS)));
    /* the Community ID: the source, and the destination reached (after DNAT) */
    if (!PyBytes_CheckExact(f[C_RSRC]) || !PyBytes_CheckExact(osrc)) return PURE;
    int64_t sport, dport;
    if (icmp) {
        sport = icmp_type;
        dport = icmp_code;
    } else {
        TRY(int_in(f[C_OSPORT], 0, 0xFFFF, &sport));
        TRY(int_in(f[C_RSPORT], 0, 0xFFFF, &dport));
    }
    TRY(community_id_of(o, sha1, seed, proto, osrc, f[C_RSRC], sport, dport));
    /* reporter: 1 when the source pod runs on this node, plus 2 when the destination pod does */
    int reporter = 0;
    if (has_meta) {
        PyObject *names[2] = {PyTuple_GET_ITEM(ctx, 6), PyTuple_GET_ITEM(ctx, 7)};
        for (int i = 0; i < 2; i++) {
            PyObject *v = PyDict_GetItemWithError(meta, names[i]);
            if (v == NULL && PyErr_Occurred()) return ERR;
            int same = same_node(node, v);
            if (same < 0) return PURE;
            reporter |= same << i;
        }
    }
    return put_byte(o, (uint8_t)(reporter << 1)) ? ERR : OK;
}

PyObject *native_encode_prefix(PyObject *self, PyObject *args) {
    PyObject *e, *ctx;
    if (!PyArg_ParseTuple(args, "OO!", &e, &PyTuple_Type, &ctx)) return NULL;
    if (PyTuple_GET_SIZE(ctx) != 8) {
        PyErr_SetString(PyExc_ValueError, "encode_prefix: the context is (node_fields, node, seed, sha1, k8s_fields, "
                                          "'flowType', 'sourceNodeName', 'destinationNodeName')");
        return NULL;
    }
    Out o = {.len = 0, .cap = sizeof o.local};
    o.p = o.local;
    int direct = bound(&e_bound, e, ENAMES, E_N);
    if (direct < 0) return NULL;
    Py_INCREF(e); /* the hash calls Python code: keep the export and its fields alive */
    PyObject *c = direct ? FIELD(e_bound, e, E_CONN) : NULL;
    Py_XINCREF(c);
    int r = encode(&o, e, ctx);
    Py_XDECREF(c);
    Py_DECREF(e);
    PyObject *out = NULL;
    if (r == OK) out = PyBytes_FromStringAndSize((const char *)o.p, o.len);
    else if (r == PURE) out = Py_NewRef(Py_NotImplemented);
    if (o.p != o.local) PyMem_Free(o.p);
    return out;
}
