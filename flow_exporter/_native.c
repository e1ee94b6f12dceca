/*
 * flow_exporter._native: the fused steady poll (issue 24). Optional: without it the decoder
 * (flow_exporter/ctnetlink.py) and the store update (flow_exporter/store/table.py) do the same work, and the
 * property tests (tests/unit/test_native.py) check that both give the same store state and the same records
 * on the same bytes, hostile ones included. Its walk of a message restates ctnetlink.py's until the fused poll
 * is ported too (issue 39).
 *
 * Why C and not Rust: the work is a loop over netlink attributes plus a handful of array writes per
 * row; the cost that matters is the Python-object boundary, which is the same C API either way. C
 * builds with setuptools and the compiler every Linux image already uses for wheels, and adds no
 * toolchain to a fresh machine, CI or the image's build stage (measured in BENCHMARKS.md).
 *
 * One function here (the admission it calls is _admit.c's; what they share, _records.c's):
 *
 *   apply_dump(buf, zones, Connection, connections, keys, labels, columns, generation, ordinal, slow,
 *              zone_counts, admission=None) -> (decoded, skipped, ignored, done, errno, interrupted, kept)
 *     The steady poll, fused: each dump row is decoded and looked up in the store's key index
 *     without making a Connection; a row whose connection is known and did not move (the common
 *     case) updates the store's columns in place, exactly as Table.update_batch would. Every other
 *     row (new, moved, reset, re-created, labelled, anything odd) becomes a Connection and goes to
 *     `slow` (Table.update_batch) in dump order: pending slow rows are handed over before a known
 *     row is looked at, so the store sees the rows in the order a pure poll would. A row is first
 *     matched against the slot its position in the dump held last poll (the kernel lists its table in
 *     the same order every time), which needs no key object; only a miss builds the key for the index.
 *     With `admission` (a callable that returns the store's admission context, _admit.c, called at the
 *     buffer's first new row; the store passes it when no hook wants new connections), a new row no
 *     earlier row waits for is admitted in place too, without a Connection: the first poll of a large
 *     table is mostly such rows.
 *
 * Nothing here raises on garbage: a malformed message is skipped and counted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

#define NLMSG_HDRLEN 16
#define NFGEN_HDRLEN 4
#define NLMSG_ERROR 2
#define NLMSG_DONE 3
#define NLM_F_DUMP_INTR 0x10
#define NLA_TYPE_MASK 0x3FFF
#define CT_NEW ((1 << 8) | 0)
#define CT_DELETE ((1 << 8) | 2)
#define AF_INET_ 2
#define AF_INET6_ 10

/* Value slots: twelve per tuple (orig at 0, reply at 12), then the message's own. */
enum {
    T_SRC, T_DST, T_PROTO, T_SPORT, T_DPORT, T_ICMP_ID, T_ICMP_TYPE, T_ICMP_CODE,
    T_ICMP6_ID, T_ICMP6_TYPE, T_ICMP6_CODE, T_ZONE, T_N
};
#define O_ 0
#define R_ T_N
enum {
    F_STATUS = 2 * T_N, F_MARK, F_ID, F_ZONE,
    F_OPK, F_OBY, F_OPK32, F_OBY32, F_RPK, F_RBY, F_RPK32, F_RBY32,
    F_START, F_STOP, F_TCP, F_LABELS, F_N
};

typedef struct {
    uint64_t have;
    uint64_t v[F_N];
    const uint8_t *p[F_N]; /* addresses and labels: where they are in the buffer */
    Py_ssize_t plen[F_N];
    int family;
} Entry;

/* The row as the store sees it (the Connection's fields that the fast path compares). */
typedef struct {
    unsigned proto;
    uint64_t sport, dport, rsport, rdport, zone, ct_id, mark, status, start, stop;
    uint64_t opk, oby, rpk, rby;
    int tcp; /* -1: none */
    int counted;
    int labelled; /* labels present and not all zero */
    int icmp;
    uint64_t icmp_type, icmp_code, icmp_id;
} Row;

#define HAS(e, f) (((e)->have >> (f)) & 1)

static inline uint64_t be(const uint8_t *p, int size) {
    uint64_t x = 0;
    for (int i = 0; i < size; i++) x = (x << 8) | p[i];
    return x;
}

/* The first occurrence of a value wins; a payload shorter than its format is malformed (checked first). */
static inline int put(Entry *e, int f, const uint8_t *buf, Py_ssize_t pos, Py_ssize_t plen, int size) {
    if (plen < size) return -1;
    if (HAS(e, f)) return 0;
    e->have |= (uint64_t)1 << f;
    if (f == T_SRC || f == T_DST || f == R_ + T_SRC || f == R_ + T_DST || f == F_LABELS) {
        e->p[f] = buf + pos;
        e->plen[f] = size;
    } else {
        e->v[f] = be(buf + pos, size);
    }
    return 0;
}

/* Validates the attribute list [start, end) as the pure walk does (every header in bounds). */
static int check_attrs(const uint8_t *buf, Py_ssize_t start, Py_ssize_t end) {
    while (start + 4 <= end) {
        uint16_t ln;
        memcpy(&ln, buf + start, 2);
        if (ln < 4 || start + ln > end) return -1;
        start += (ln + 3) & ~3;
    }
    return 0;
}

/* Walks an attribute list already validated by check_attrs. */
typedef struct {
    const uint8_t *buf;
    Py_ssize_t at, end;
} Attrs;

static inline int attr_next(Attrs *it, int *ty, Py_ssize_t *pos, Py_ssize_t *plen) {
    if (it->at + 4 > it->end) return 0;
    uint16_t ln, t;
    memcpy(&ln, it->buf + it->at, 2);
    memcpy(&t, it->buf + it->at + 2, 2);
    *ty = t & NLA_TYPE_MASK;
    *pos = it->at + 4;
    *plen = (Py_ssize_t)ln - 4;
    it->at += (ln + 3) & ~3;
    return 1;
}

#define FOR_ATTRS(b, start, end, ty, pos, plen)     \
    int ty;                                         \
    Py_ssize_t pos, plen;                           \
    Attrs ty##_it = {(b), (start), (end)};          \
    while (attr_next(&ty##_it, &ty, &pos, &plen))

static int walk_tuple(Entry *e, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, int base) {
    if (check_attrs(buf, start, end)) return -1;
    FOR_ATTRS(buf, start, end, ty, pos, plen) {
        if (ty == 1) { /* CTA_TUPLE_IP */
            if (check_attrs(buf, pos, pos + plen)) return -1;
            FOR_ATTRS(buf, pos, pos + plen, ity, ipos, iplen) {
                int fam, size, f;
                switch (ity) {
                case 1: fam = AF_INET_; size = 4; f = T_SRC; break;
                case 2: fam = AF_INET_; size = 4; f = T_DST; break;
                case 3: fam = AF_INET6_; size = 16; f = T_SRC; break;
                case 4: fam = AF_INET6_; size = 16; f = T_DST; break;
                default: continue;
                }
                if (fam != e->family) return -1;
                if (put(e, base + f, buf, ipos, iplen, size)) return -1;
            }
        } else if (ty == 2) { /* CTA_TUPLE_PROTO */
            if (check_attrs(buf, pos, pos + plen)) return -1;
            FOR_ATTRS(buf, pos, pos + plen, pty, ppos, pplen) {
                int f, size;
                switch (pty) {
                case 1: f = T_PROTO; size = 1; break;
                case 2: f = T_SPORT; size = 2; break;
                case 3: f = T_DPORT; size = 2; break;
                case 4: f = T_ICMP_ID; size = 2; break;
                case 5: f = T_ICMP_TYPE; size = 1; break;
                case 6: f = T_ICMP_CODE; size = 1; break;
                case 7: f = T_ICMP6_ID; size = 2; break;
                case 8: f = T_ICMP6_TYPE; size = 1; break;
                case 9: f = T_ICMP6_CODE; size = 1; break;
                default: continue;
                }
                if (put(e, base + f, buf, ppos, pplen, size)) return -1;
            }
        } else if (ty == 3) { /* CTA_TUPLE_ZONE */
            if (put(e, base + T_ZONE, buf, pos, plen, 2)) return -1;
        }
    }
    return 0;
}

static int walk_nested(Entry *e, const uint8_t *buf, Py_ssize_t start, Py_ssize_t end, const int *map, const int *sizes,
                       int nmap) {
    if (check_attrs(buf, start, end)) return -1;
    FOR_ATTRS(buf, start, end, ty, pos, plen) {
        if (ty >= 1 && ty <= nmap && map[ty - 1] >= 0) {
            if (put(e, map[ty - 1], buf, pos, plen, sizes[ty - 1])) return -1;
        }
    }
    return 0;
}

static const int MAP_OCOUNT[] = {F_OPK, F_OBY, F_OPK32, F_OBY32};
static const int MAP_RCOUNT[] = {F_RPK, F_RBY, F_RPK32, F_RBY32};
static const int SIZE_COUNT[] = {8, 8, 4, 4};
static const int MAP_TS[] = {F_START, F_STOP};
static const int SIZE_TS[] = {8, 8};

/* The generic walk of one message (after the nlmsghdr checks): 0 and a filled Entry, or -1 (skip it). */
static int walk_message(Entry *e, const uint8_t *buf, Py_ssize_t off, Py_ssize_t mlen) {
    if (mlen < NLMSG_HDRLEN + NFGEN_HDRLEN) return -1;
    int family = buf[off + NLMSG_HDRLEN];
    if (family != AF_INET_ && family != AF_INET6_) return -1;
    e->have = 0;
    e->family = family;
    Py_ssize_t start = off + NLMSG_HDRLEN + NFGEN_HDRLEN, end = off + mlen;
    if (check_attrs(buf, start, end)) return -1;
    FOR_ATTRS(buf, start, end, ty, pos, plen) {
        switch (ty) {
        case 1: if (walk_tuple(e, buf, pos, pos + plen, O_)) return -1; break;
        case 2: if (walk_tuple(e, buf, pos, pos + plen, R_)) return -1; break;
        case 3: if (put(e, F_STATUS, buf, pos, plen, 4)) return -1; break;
        case 8: if (put(e, F_MARK, buf, pos, plen, 4)) return -1; break;
        case 12: if (put(e, F_ID, buf, pos, plen, 4)) return -1; break;
        case 18: if (put(e, F_ZONE, buf, pos, plen, 2)) return -1; break;
        case 9: if (walk_nested(e, buf, pos, pos + plen, MAP_OCOUNT, SIZE_COUNT, 4)) return -1; break;
        case 10: if (walk_nested(e, buf, pos, pos + plen, MAP_RCOUNT, SIZE_COUNT, 4)) return -1; break;
        case 20: if (walk_nested(e, buf, pos, pos + plen, MAP_TS, SIZE_TS, 2)) return -1; break;
        case 4: { /* CTA_PROTOINFO > CTA_PROTOINFO_TCP > CTA_PROTOINFO_TCP_STATE */
            if (check_attrs(buf, pos, pos + plen)) return -1;
            FOR_ATTRS(buf, pos, pos + plen, pty, ppos, pplen) {
                if (pty != 1) continue;
                if (check_attrs(buf, ppos, ppos + pplen)) return -1;
                FOR_ATTRS(buf, ppos, ppos + pplen, sty, spos, splen) {
                    if (sty == 1 && put(e, F_TCP, buf, spos, splen, 1)) return -1;
                }
            }
            break;
        }
        case 22:
            if (plen && put(e, F_LABELS, buf, pos, plen, (int)plen)) return -1;
            break;
        default: break;
        }
    }
    const int required[] = {O_ + T_SRC, O_ + T_DST, O_ + T_PROTO, R_ + T_SRC, R_ + T_DST, R_ + T_PROTO};
    for (int i = 0; i < 6; i++)
        if (!HAS(e, required[i])) return -1;
    return 0;
}

static inline uint64_t pick(const Entry *e, int f) { return HAS(e, f) ? e->v[f] : 0; }
static inline uint64_t pick2(const Entry *e, int f, int g) { return HAS(e, f) ? e->v[f] : pick(e, g); }

/* The Connection's field values from an Entry (decode.py `_sources`). */
static void to_row(const Entry *e, Row *r) {
    unsigned proto = (unsigned)e->v[O_ + T_PROTO];
    r->proto = proto;
    r->icmp = proto == 1 || proto == 58;
    if (r->icmp) {
        int id = proto == 1 ? T_ICMP_ID : T_ICMP6_ID;
        int type = proto == 1 ? T_ICMP_TYPE : T_ICMP6_TYPE;
        int code = proto == 1 ? T_ICMP_CODE : T_ICMP6_CODE;
        r->sport = pick(e, O_ + id);
        r->dport = pick(e, O_ + type) << 8 | pick(e, O_ + code);
        r->rsport = pick(e, R_ + id);
        r->rdport = pick(e, R_ + type) << 8 | pick(e, R_ + code);
        r->icmp_type = pick(e, O_ + type);
        r->icmp_code = pick(e, O_ + code);
        r->icmp_id = pick(e, O_ + id);
    } else {
        r->sport = pick(e, O_ + T_SPORT);
        r->dport = pick(e, O_ + T_DPORT);
        r->rsport = pick(e, R_ + T_SPORT);
        r->rdport = pick(e, R_ + T_DPORT);
    }
    r->zone = HAS(e, F_ZONE) ? e->v[F_ZONE] : pick2(e, O_ + T_ZONE, R_ + T_ZONE);
    r->ct_id = pick(e, F_ID);
    r->mark = pick(e, F_MARK);
    r->status = pick(e, F_STATUS);
    r->tcp = HAS(e, F_TCP) ? (int)e->v[F_TCP] : -1;
    r->opk = pick2(e, F_OPK, F_OPK32);
    r->oby = pick2(e, F_OBY, F_OBY32);
    r->rpk = pick2(e, F_RPK, F_RPK32);
    r->rby = pick2(e, F_RBY, F_RBY32);
    r->start = pick(e, F_START);
    r->stop = pick(e, F_STOP);
    r->counted = HAS(e, F_OPK) || HAS(e, F_OPK32) || HAS(e, F_RPK) || HAS(e, F_RPK32);
    r->labelled = 0;
    if (HAS(e, F_LABELS)) {
        for (Py_ssize_t i = 0; i < e->plen[F_LABELS]; i++)
            if (e->p[F_LABELS][i]) { r->labelled = 1; break; }
    }
}

static PyObject *addr(const Entry *e, int f) { return PyBytes_FromStringAndSize((const char *)e->p[f], e->plen[f]); }

/* Connection's fields in its positional order (flow_exporter/connection.py). */
static const char *const FIELDS[26] = {
    "family", "proto", "orig_src", "orig_dst", "orig_sport", "orig_dport", "reply_src", "reply_dst",
    "reply_sport", "reply_dport", "zone", "ct_id", "mark", "labels", "status", "tcp_state", "orig_packets",
    "orig_bytes", "reply_packets", "reply_bytes", "start_ns", "stop_ns", "icmp_type", "icmp_code", "icmp_id",
    "counted"};

/* Where each field lives in a Connection (a slots dataclass): filling the slots directly skips the generated
 * Python __init__, the larger part of a decoded entry's cost. Resolved once per class; a class whose fields
 * are not plain object slots is called instead. */
static SlotCache bound;

static int bind(PyObject *ctype) { return slot_cache(&bound, ctype, FIELDS, 26) < 0 ? -1 : 0; }

/* The item of `key` (a row_key tuple, or NULL) at i, as a new reference; else `made`, a new object. */
#define FROM_KEY(key, i, made) ((key) != NULL ? Py_NewRef(PyTuple_GET_ITEM(key, i)) : (made))

/* A new reference to the Connection of an Entry. `key` (borrowed, or NULL) is the row's row_key tuple when the
 * caller built one to look the row up: the Connection takes its objects rather than new equal ones, so the
 * addresses' hashes, computed by that lookup, are not computed again when the row is admitted (a first poll
 * of a 1M table builds both for every row). */
static PyObject *make_connection(PyObject *ctype, const Entry *e, const Row *r, PyObject *key) {
    PyObject *a[26] = {0};
    PyObject *res = NULL;
    int i = 0;
    if (bind(ctype)) return NULL;
    a[i++] = PyLong_FromLong(e->family);
    a[i++] = FROM_KEY(key, 1, PyLong_FromUnsignedLong(r->proto));
    a[i++] = FROM_KEY(key, 2, addr(e, O_ + T_SRC));
    a[i++] = addr(e, O_ + T_DST);
    a[i++] = FROM_KEY(key, 3, PyLong_FromUnsignedLongLong(r->sport));
    a[i++] = FROM_KEY(r->icmp ? key : NULL, 5, PyLong_FromUnsignedLongLong(r->dport));
    a[i++] = FROM_KEY(key, 4, addr(e, R_ + T_SRC));
    a[i++] = addr(e, R_ + T_DST);
    a[i++] = FROM_KEY(r->icmp ? NULL : key, 5, PyLong_FromUnsignedLongLong(r->rsport));
    a[i++] = PyLong_FromUnsignedLongLong(r->rdport);
    a[i++] = FROM_KEY(key, 0, PyLong_FromUnsignedLongLong(r->zone));
    a[i++] = PyLong_FromUnsignedLongLong(r->ct_id);
    a[i++] = PyLong_FromUnsignedLongLong(r->mark);
    if (r->labelled) a[i++] = addr(e, F_LABELS);
    else a[i++] = Py_NewRef(Py_None);
    a[i++] = PyLong_FromUnsignedLongLong(r->status);
    a[i++] = r->tcp < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(r->tcp);
    a[i++] = PyLong_FromUnsignedLongLong(r->opk);
    a[i++] = PyLong_FromUnsignedLongLong(r->oby);
    a[i++] = PyLong_FromUnsignedLongLong(r->rpk);
    a[i++] = PyLong_FromUnsignedLongLong(r->rby);
    a[i++] = PyLong_FromUnsignedLongLong(r->start);
    a[i++] = PyLong_FromUnsignedLongLong(r->stop);
    if (r->icmp) {
        a[i++] = PyLong_FromUnsignedLongLong(r->icmp_type);
        a[i++] = PyLong_FromUnsignedLongLong(r->icmp_code);
        a[i++] = PyLong_FromUnsignedLongLong(r->icmp_id);
    } else {
        a[i++] = Py_NewRef(Py_None);
        a[i++] = Py_NewRef(Py_None);
        a[i++] = Py_NewRef(Py_None);
    }
    a[i++] = PyBool_FromLong(r->counted);
    for (int k = 0; k < 26; k++)
        if (a[k] == NULL) goto done;
    if (bound.direct) {
        PyTypeObject *t = (PyTypeObject *)ctype;
        res = t->tp_alloc(t, 0);
        if (res == NULL) goto done;
        for (int k = 0; k < 26; k++) {
            SLOT_AT(bound, res, k) = a[k]; /* the slot takes the reference */
            a[k] = NULL;
        }
    } else {
        res = PyObject_Vectorcall(ctype, a, 26, NULL);
    }
done:
    for (int k = 0; k < 26; k++) Py_XDECREF(a[k]);
    return res;
}

/* zones is None or a container: keep the row? -1 on error. */
static int keep_zone(PyObject *zones, uint64_t zone) {
    if (zones == Py_None) return 1;
    PyObject *z = PyLong_FromUnsignedLongLong(zone);
    if (z == NULL) return -1;
    int r = PySequence_Contains(zones, z);
    Py_DECREF(z);
    return r;
}

typedef struct {
    Py_ssize_t decoded, skipped, ignored, kept;
    int done, interrupted;
    long err;
} Result;

static PyObject *result_tuple(const Result *res) {
    return Py_BuildValue("(nnnOlOn)", res->decoded, res->skipped, res->ignored, res->done ? Py_True : Py_False,
                         res->err, res->interrupted ? Py_True : Py_False, res->kept);
}

/* One step of the message loop shared by both functions: 1 a CT message at *off (mlen, mtype set),
 * 0 the next message, 2 stop. */
static int next_message(const uint8_t *buf, Py_ssize_t n, Py_ssize_t *off, Result *res, uint32_t *mlen_out,
                        uint16_t *mtype_out) {
    while (*off + NLMSG_HDRLEN <= n) {
        uint32_t mlen;
        uint16_t mtype, mflags;
        memcpy(&mlen, buf + *off, 4);
        memcpy(&mtype, buf + *off + 4, 2);
        memcpy(&mflags, buf + *off + 6, 2);
        if (mlen < NLMSG_HDRLEN || (Py_ssize_t)mlen > n - *off) {
            res->skipped++;
            return 2;
        }
        if (mflags & NLM_F_DUMP_INTR) res->interrupted = 1;
        Py_ssize_t here = *off;
        *off += ((Py_ssize_t)mlen + 3) & ~(Py_ssize_t)3;
        if (mtype == CT_NEW || mtype == CT_DELETE) {
            *mlen_out = mlen;
            *mtype_out = mtype;
            *off = here; /* the caller advances */
            return 1;
        } else if (mtype == NLMSG_DONE) {
            res->done = 1;
            if (mlen >= NLMSG_HDRLEN + 4) {
                int32_t err;
                memcpy(&err, buf + here + NLMSG_HDRLEN, 4);
                if (err < 0 && !res->err) res->err = -(long)err;
            }
            return 2;
        } else if (mtype == NLMSG_ERROR) {
            if (mlen < NLMSG_HDRLEN + 4) {
                res->skipped++;
            } else {
                int32_t err;
                memcpy(&err, buf + here + NLMSG_HDRLEN, 4);
                if (err && !res->err) res->err = err < 0 ? -(long)err : (long)err;
            }
        } else {
            res->ignored++;
        }
    }
    return 2;
}

/* The next message of the buffer that decodes to an entry passing the zone filter: 1 (e, r and *mtype set),
 * 0 at the buffer's end, -1 on error (an exception set). Skipped and decoded messages are counted in res. */
static int next_entry(const uint8_t *buf, Py_ssize_t n, Py_ssize_t *off, Result *res, PyObject *zones, Entry *e, Row *r,
                      uint16_t *mtype) {
    uint32_t mlen;
    while (next_message(buf, n, off, res, &mlen, mtype) == 1) {
        Py_ssize_t here = *off;
        *off += ((Py_ssize_t)mlen + 3) & ~(Py_ssize_t)3;
        if (walk_message(e, buf, here, mlen)) {
            res->skipped++;
            continue;
        }
        res->decoded++;
        to_row(e, r);
        int keep = keep_zone(zones, r->zone);
        if (keep) return keep < 0 ? -1 : 1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------- the fused poll */

enum { C_SEEN, C_CT, C_START, C_FIRST, C_SEQ, C_BITS, C_OP, C_OB, C_RP, C_RB, C_TCP, C_STATUS, C_MARK,
       C_LAST_ACTIVE, C_ORDER, C_N };
static const Py_ssize_t COL_SIZE[C_N] = {4, 4, 8, 8, 4, 1, 8, 8, 8, 8, 1, 4, 4, 8, 8};

/* Bits of a slot's state column (flow_exporter/store/columns.py). */
#define B_PRESENT 1
#define B_DESTROYED 4
#define B_ORPHAN 32
#define B_UNCOUNTED 128

typedef struct {
    Py_buffer b[C_N];
    int held;
    Py_ssize_t slots;  /* slots every slot column has */
    Py_ssize_t orders; /* rows the dump-order column has room for */
} Cols;

static void cols_release(Cols *c) {
    columns_release(c->b, c->held);
    c->held = 0;
}

static int cols_acquire(Cols *c, PyObject *columns) {
    c->held = 0;
    if (columns_acquire(c->b, columns, C_N, COL_SIZE)) return -1;
    c->held = C_N;
    c->slots = PY_SSIZE_T_MAX;
    for (int i = 0; i < C_N; i++) {
        Py_ssize_t len = c->b[i].len / COL_SIZE[i];
        if (i == C_ORDER) c->orders = len;
        else if (len < c->slots) c->slots = len;
    }
    return 0;
}

#define COL(c, i, T) ((T *)(c)->b[i].buf)

/* The lookup key of a row: (zone, proto, orig_src, sport, reply_src, dport), as Connection.key builds it. */
static PyObject *row_key(const Entry *e, const Row *r) {
    PyObject *t = PyTuple_New(6);
    if (t == NULL) return NULL;
    PyObject *items[6] = {
        PyLong_FromUnsignedLongLong(r->zone), PyLong_FromUnsignedLong(r->proto), addr(e, O_ + T_SRC),
        PyLong_FromUnsignedLongLong(r->sport), addr(e, R_ + T_SRC),
        PyLong_FromUnsignedLongLong(r->icmp ? r->dport : r->rsport),
    };
    for (int i = 0; i < 6; i++) {
        if (items[i] == NULL) {
            for (int k = 0; k < 6; k++) Py_XDECREF(items[k]);
            for (int k = 0; k < 6; k++) PyTuple_SET_ITEM(t, k, NULL);
            Py_DECREF(t);
            return NULL;
        }
    }
    for (int i = 0; i < 6; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
}

static inline int long_is(PyObject *o, uint64_t v) {
    if (!PyLong_CheckExact(o)) return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow && x >= 0 && (uint64_t)x == v;
}

static inline int bytes_is(PyObject *o, const uint8_t *p, Py_ssize_t n) {
    return PyBytes_CheckExact(o) && PyBytes_GET_SIZE(o) == n && memcmp(PyBytes_AS_STRING(o), p, (size_t)n) == 0;
}

/* Whether slot s holds this row's tuple in the keyed table: a dump lists the table in the same order poll after
 * poll, so the slot the same row position had last time is checked first, without building the key. A slot
 * that holds a key and is not an orphan is the one the key index maps it to (Table keeps that invariant). */
static int slot_holds(Cols *c, PyObject *keys, Py_ssize_t s, const Entry *e, const Row *r) {
    if (s < 0 || s >= c->slots || s >= PyList_GET_SIZE(keys)) return 0;
    if (COL(c, C_BITS, uint8_t)[s] & B_ORPHAN) return 0;
    PyObject *k = PyList_GET_ITEM(keys, s);
    if (!PyTuple_CheckExact(k) || PyTuple_GET_SIZE(k) != 6) return 0;
    return long_is(PyTuple_GET_ITEM(k, 3), r->sport) &&
           bytes_is(PyTuple_GET_ITEM(k, 2), e->p[O_ + T_SRC], e->plen[O_ + T_SRC]) &&
           long_is(PyTuple_GET_ITEM(k, 5), r->icmp ? r->dport : r->rsport) &&
           bytes_is(PyTuple_GET_ITEM(k, 4), e->p[R_ + T_SRC], e->plen[R_ + T_SRC]) &&
           long_is(PyTuple_GET_ITEM(k, 1), r->proto) && long_is(PyTuple_GET_ITEM(k, 0), r->zone);
}

/* Apply a known row in place if Table.update_batch would only write its status, seen mark, counted bit and stop
 * time: 1 done, 0 leave it to the slow path (nothing written). Mirrors update_batch line by line. */
static int fast_update(Cols *c, Py_ssize_t s, const Row *r, uint64_t gen, int labels_hold_s) {
    uint32_t *seen = COL(c, C_SEEN, uint32_t);
    if ((uint64_t)seen[s] == gen) return 1; /* the same tuple twice in one dump: keep the first */
    if (r->start > (uint64_t)INT64_MAX || r->stop > (uint64_t)INT64_MAX) return 0;
    uint64_t old_ct = COL(c, C_CT, uint32_t)[s];
    int64_t old_start = COL(c, C_START, int64_t)[s];
    int64_t cstart = (int64_t)r->start;
    if ((old_ct != r->ct_id && old_ct && r->ct_id) || (old_start != cstart && old_start && cstart) ||
        (!old_start && cstart && (cstart > COL(c, C_FIRST, int64_t)[s] || COL(c, C_SEQ, uint32_t)[s])))
        return 0; /* a new incarnation */
    uint8_t b = COL(c, C_BITS, uint8_t)[s];
    if (b & B_DESTROYED) {
        seen[s] = (uint32_t)gen;
        return 1; /* a dump older than its DESTROY event */
    }
    if (r->oby < COL(c, C_OB, uint64_t)[s] || r->rby < COL(c, C_RB, uint64_t)[s] ||
        r->opk < COL(c, C_OP, uint64_t)[s] || r->rpk < COL(c, C_RP, uint64_t)[s])
        return 0; /* a counter reset */
    if (r->opk > COL(c, C_OP, uint64_t)[s] || r->rpk > COL(c, C_RP, uint64_t)[s] ||
        r->tcp != (int)COL(c, C_TCP, int8_t)[s])
        return 0; /* it moved: the expiry queue has work */
    if (old_start != cstart) return 0; /* learns its start stamp */
    if (old_ct != r->ct_id || COL(c, C_MARK, uint32_t)[s] != r->mark || r->labelled || labels_hold_s) return 0;
    if (!(b & B_PRESENT)) return 0; /* the previous dump missed it */
    if (r->status > UINT32_MAX) return 0;
    seen[s] = (uint32_t)gen;
    if (!r->counted) b |= B_UNCOUNTED;
    else b &= (uint8_t)~B_UNCOUNTED;
    COL(c, C_BITS, uint8_t)[s] = b;
    COL(c, C_STATUS, uint32_t)[s] = (uint32_t)r->status;
    if (r->stop) COL(c, C_LAST_ACTIVE, int64_t)[s] = (int64_t)r->stop;
    return 1;
}

/* Hand the pending slow rows to `slow` (the columns are released meanwhile: it may grow them, and the
 * admission reads its context again after it). */
static int flush(PyObject *slow, PyObject **pending, Cols *c, PyObject *columns, Admission *adm) {
    if (PyList_GET_SIZE(*pending) == 0) return 0;
    cols_release(c);
    if (adm != NULL && admission_pause(adm)) return -1;
    PyObject *rows = *pending;
    *pending = PyList_New(0);
    if (*pending == NULL) {
        Py_DECREF(rows);
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(slow, rows);
    Py_DECREF(rows);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (adm != NULL && admission_resume(adm)) return -1;
    return cols_acquire(c, columns);
}

/* A new row's values for the admission: its addresses where they lie in the buffer (the admission copies them
 * into the row's static bytes, no object of their own), a new reference to its labels; -1 on error, 0 when a
 * value does not fit the admission's types (the row goes the Connection's way). */
static int row_vals(const Entry *e, const Row *r, AdmitVals *v) {
    if (r->start > INT64_MAX || r->stop > INT64_MAX) return 0;
    v->odst = e->p[O_ + T_DST];
    v->odst_len = e->plen[O_ + T_DST];
    v->rdst = e->p[R_ + T_DST];
    v->rdst_len = e->plen[R_ + T_DST];
    v->labels = r->labelled ? addr(e, F_LABELS) : Py_NewRef(Py_None);
    if (v->labels == NULL) return -1;
    v->opk = r->opk;
    v->oby = r->oby;
    v->rpk = r->rpk;
    v->rby = r->rby;
    v->ct = r->ct_id;
    v->mark = r->mark;
    v->status = r->status;
    v->odport = r->dport;
    v->rsport = r->rsport;
    v->rdport = r->rdport;
    v->start = (int64_t)r->start;
    v->stop = (int64_t)r->stop;
    v->tcp = r->tcp;
    v->counted = r->counted;
    v->icmp = r->icmp ? 7 : 0; /* make_connection: type, code and id, or none of them */
    return 1;
}

/* A row the store does not hold, admitted straight from the dump (no Connection made): 1 admitted, 0 not (the
 * row goes the Connection's way), -1 an error. */
static int admit_row(Admission *adm, PyObject *key, const Entry *e, const Row *r, Py_ssize_t *slot) {
    AdmitVals v;
    int got = row_vals(e, r, &v);
    if (got <= 0) return got;
    got = admission_one(adm, key, &v, 0, NULL, slot);
    Py_DECREF(v.labels);
    return got < 0 ? -1 : got == 1;
}

static int count_zone(PyObject *zone_counts, uint64_t zone, Py_ssize_t count) {
    if (count == 0) return 0;
    PyObject *z = PyLong_FromUnsignedLongLong(zone);
    if (z == NULL) return -1;
    PyObject *old = PyDict_GetItemWithError(zone_counts, z);
    Py_ssize_t have = 0;
    if (old == NULL && PyErr_Occurred()) goto fail;
    if (old != NULL) have = PyLong_AsSsize_t(old);
    if (have == -1 && PyErr_Occurred()) goto fail;
    PyObject *v = PyLong_FromSsize_t(have + count);
    if (v == NULL) goto fail;
    int rc = PyDict_SetItem(zone_counts, z, v);
    Py_DECREF(v);
    Py_DECREF(z);
    return rc;
fail:
    Py_DECREF(z);
    return -1;
}

/* The slot of a row in the keyed table, or -1 (unknown); -2 on error. *key_out gets the key built for the lookup
 * (a new reference, for make_connection; anything it held is released first). */
static Py_ssize_t find_slot(PyObject *conns, const Entry *e, const Row *r, PyObject **key_out) {
    Py_CLEAR(*key_out);
    PyObject *key = row_key(e, r);
    if (key == NULL) return -2;
    *key_out = key;
    PyObject *slot = PyDict_GetItemWithError(conns, key);
    if (slot == NULL) return PyErr_Occurred() ? -2 : -1;
    Py_ssize_t s = PyLong_AsSsize_t(slot);
    if (s == -1 && PyErr_Occurred()) return -2;
    return s < 0 ? -1 : s;
}

static PyObject *native_apply_dump(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    PyObject *zones, *ctype, *conns, *keys, *labels, *columns, *slow, *zone_counts, *admission = Py_None;
    unsigned long long gen;
    Py_ssize_t ordinal;
    if (!PyArg_ParseTuple(args, "y*OOO!O!O!O!KnOO!|O", &view, &zones, &ctype, &PyDict_Type, &conns, &PyList_Type,
                          &keys, &PyDict_Type, &labels, &PyTuple_Type, &columns, &gen, &ordinal, &slow, &PyDict_Type,
                          &zone_counts, &admission))
        return NULL;
    if (PyTuple_GET_SIZE(columns) != C_N) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_TypeError, "expected %d columns", C_N);
        return NULL;
    }
    Cols c = {0};
    Admission *adm = NULL; /* new rows admitted in place: opened at the first, when the store passed its context */
    PyObject *pending = PyList_New(0);
    if (pending == NULL || cols_acquire(&c, columns)) {
        Py_XDECREF(pending);
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint8_t *buf = view.buf;
    Py_ssize_t n = view.len, off = 0;
    Result res = {0};
    Entry e;
    Row r;
    PyObject *key = NULL; /* the current row's lookup key, when find_slot built one */
    uint16_t mtype;
    uint64_t run_zone = 0;
    Py_ssize_t run = 0;
    int got;
    while ((got = next_entry(buf, n, &off, &res, zones, &e, &r, &mtype)) == 1) {
        Py_ssize_t pos = ordinal + res.kept; /* this row's position among the dump's kept rows */
        res.kept++;
        if (run && r.zone != run_zone) {
            if (count_zone(zone_counts, run_zone, run)) goto fail;
            run = 0;
        }
        run_zone = r.zone;
        run++;
        int64_t *order = COL(&c, C_ORDER, int64_t);
        Py_ssize_t s = -1;
        Py_CLEAR(key);
        if (pos < c.orders && slot_holds(&c, keys, (Py_ssize_t)order[pos], &e, &r)) s = (Py_ssize_t)order[pos];
        else if ((s = find_slot(conns, &e, &r, &key)) == -2) goto fail;
        if (s >= 0 && PyList_GET_SIZE(pending)) {
            /* earlier rows first: they may change what this one finds */
            if (flush(slow, &pending, &c, columns, adm)) goto fail;
            if ((s = find_slot(conns, &e, &r, &key)) == -2) goto fail;
            order = COL(&c, C_ORDER, int64_t);
        }
        if (s == -1 && admission != Py_None && PyList_GET_SIZE(pending) == 0) { /* new; no earlier row waits */
            if (adm == NULL) { /* the first new row of this buffer: a steady poll's buffers have none */
                PyObject *context = PyObject_CallNoArgs(admission);
                adm = context != NULL ? admission_open(conns, context) : NULL;
                Py_XDECREF(context);
                if (adm == NULL) goto fail;
            }
            Py_ssize_t slot;
            int got = admit_row(adm, key, &e, &r, &slot);
            if (got < 0) goto fail;
            if (got) {
                if (pos < c.orders) order[pos] = slot;
                continue;
            }
        }
        int done = 0;
        if (s >= 0 && s < c.slots) {
            if (pos < c.orders) order[pos] = s;
            int held = 0;
            if (PyDict_GET_SIZE(labels)) {
                PyObject *so = PyLong_FromSsize_t(s);
                if (so == NULL) goto fail;
                held = PyDict_Contains(labels, so);
                Py_DECREF(so);
                if (held < 0) goto fail;
            }
            done = fast_update(&c, s, &r, gen, held);
        }
        if (!done) {
            PyObject *conn = make_connection(ctype, &e, &r, key);
            if (conn == NULL) goto fail;
            int rc = PyList_Append(pending, conn);
            Py_DECREF(conn);
            if (rc) goto fail;
        }
    }
    Py_CLEAR(key);
    if (got < 0) goto fail;
    if (count_zone(zone_counts, run_zone, run)) goto fail;
    if (flush(slow, &pending, &c, columns, adm)) goto fail;
    cols_release(&c);
    Py_DECREF(pending);
    PyBuffer_Release(&view);
    if (admission_close(adm)) return NULL;
    return result_tuple(&res);
fail:
    admission_close(adm);
    cols_release(&c);
    Py_XDECREF(key);
    Py_XDECREF(pending);
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef methods[] = {
    {"apply_dump", native_apply_dump, METH_VARARGS,
     "apply_dump(buf, zones, Connection, connections, keys, labels, columns, generation, ordinal, slow, zone_counts, "
     "admission=None): "
     "one dump buffer decoded and applied to the store (see flow_exporter.store.table)."},
    {"admit_rows", native_admit_rows, METH_VARARGS,
     "admit_rows(rows, start, Connection, connections, context): a run of new connections admitted; the index "
     "it stopped at (see flow_exporter.store.table and _admit.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "flow_exporter._native", "The compiled poll and record paths (issue 24); optional.", -1, methods,
    NULL, NULL, NULL, NULL};

/* The heap's C interface, the one place it is included (its function pointers are static to this file). */
#include "deadline_heap_api.h"

int heap_check(PyObject *o) {
    if (is_heap(o)) return 1;
    PyErr_Format(PyExc_TypeError, "expected a DeadlineHeap, got %.100s", Py_TYPE(o)->tp_name);
    return 0;
}
int heap_push(PyObject *heap, int64_t ms, uint32_t slot) { return push_entry(heap, ms, slot); }

PyMODINIT_FUNC PyInit__native(void) {
    if (import_flow_exporter__deadline_heap() < 0) return NULL;
    return PyModule_Create(&module);
}
