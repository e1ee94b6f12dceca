/*
 * Delivery reports, compiled (issue 24), part of flow_exporter._native.
 *
 *   produce_run(...): records handed to librdkafka, a run at a time (below).
 *
 *   Deliveries(append, on_failed, on_run, DeliveryReport)   one per sink
 *     .for_record(export, topic, st) -> a callable for confluent-kafka's on_delivery of one record
 *     .settle()                      -> the delivered records' accounting so far, handed to on_run
 *
 * What sink.kafka.KafkaSink._on_delivery does for one record, without a Python frame per record: a delivered
 * record's DeliveryReport (partition and offset included) is appended with `append` at once, in report order;
 * its accounting (the sink's acked count, the topic's health) is added up while the records delivered in a
 * row go to one topic, and handed to `on_run(topic, st, count)` when the topic changes, before a failure's
 * report, and at `settle()` (the sink settles after every poll and flush, before anyone reads the counts).
 * A failed record goes to `on_failed(export, topic, st, err, msg)`, the Python method, in its turn.
 *
 * Why compiled: bench/bench_app_export.py measured the per-record callable (a functools.partial, which the
 * garbage collector tracks) and the Python callback at about 1.2 us of the record path's 6 us; the plain
 * confluent-kafka loop it is compared with pays for one plain function call per record. A Delivery here is not
 * tracked by the garbage collector: it holds a record, two names and its owner, and nothing refers back to it
 * but librdkafka's queue.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_records.h"

enum { R_EXPORT, R_DELIVERED, R_ERROR, R_PERMANENT, R_PARTITION, R_OFFSET, R_N };
static const char *const RNAMES[R_N] = {"export", "delivered", "error", "permanent", "partition", "offset"};

typedef struct {
    PyObject_HEAD
    PyObject *append, *on_failed, *on_run, *report_type;
    Py_ssize_t off[R_N];
    PyObject *run_topic, *run_st; /* the run of delivered records not yet handed to on_run */
    Py_ssize_t run_n;
} Deliveries;

typedef struct {
    PyObject_HEAD
    Deliveries *owner;
    PyObject *export, *topic, *st;
} Delivery;

static PyTypeObject DeliveriesType, DeliveryType;

/* Hand the run so far to on_run; 0, or -1 with the exception set. */
static int settle_run(Deliveries *d) {
    if (d->run_n == 0) return 0;
    PyObject *topic = d->run_topic, *st = d->run_st;
    Py_ssize_t n = d->run_n;
    d->run_topic = d->run_st = NULL;
    d->run_n = 0;
    PyObject *r = PyObject_CallFunction(d->on_run, "OOn", topic, st, n);
    Py_DECREF(topic);
    Py_DECREF(st);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *delivery_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    Delivery *r = (Delivery *)self;
    PyObject *err, *msg;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "a delivery callback takes (err, msg)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO", &err, &msg)) return NULL;
    Deliveries *d = r->owner;
    if (err != Py_None) {
        if (settle_run(d)) return NULL;
        return PyObject_CallFunctionObjArgs(d->on_failed, r->export, r->topic, r->st, err, msg, NULL);
    }
    if (d->run_n && d->run_st != r->st && settle_run(d)) return NULL;
    static PyObject *s_partition = NULL, *s_offset = NULL; /* interned once: a method name per call costs */
    if (s_partition == NULL && (s_partition = PyUnicode_InternFromString("partition")) == NULL) return NULL;
    if (s_offset == NULL && (s_offset = PyUnicode_InternFromString("offset")) == NULL) return NULL;
    PyObject *partition = PyObject_CallMethodNoArgs(msg, s_partition);
    if (partition == NULL) return NULL;
    PyObject *offset = PyObject_CallMethodNoArgs(msg, s_offset);
    if (offset == NULL) {
        Py_DECREF(partition);
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)d->report_type;
    PyObject *report = type->tp_alloc(type, 0);
    if (report == NULL) {
        Py_DECREF(partition);
        Py_DECREF(offset);
        return NULL;
    }
    PyObject *v[R_N] = {Py_NewRef(r->export), Py_NewRef(Py_True), Py_NewRef(Py_None), Py_NewRef(Py_False),
                        partition, offset};
    for (int i = 0; i < R_N; i++) *(PyObject **)((char *)report + d->off[i]) = v[i];
    PyObject_GC_UnTrack(report); /* it holds a record and four values: no cycle (see make_export) */
    PyObject *res = PyObject_CallOneArg(d->append, report);
    Py_DECREF(report);
    if (res == NULL) return NULL;
    Py_DECREF(res);
    if (d->run_n == 0) {
        d->run_topic = Py_NewRef(r->topic);
        d->run_st = Py_NewRef(r->st);
    }
    d->run_n++;
    Py_RETURN_NONE;
}

static void delivery_dealloc(PyObject *self) {
    Delivery *r = (Delivery *)self;
    Py_XDECREF(r->owner);
    Py_XDECREF(r->export);
    Py_XDECREF(r->topic);
    Py_XDECREF(r->st);
    PyObject_Free(self);
}

static PyTypeObject DeliveryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flow_exporter._native.Delivery",
    .tp_basicsize = sizeof(Delivery),
    .tp_dealloc = delivery_dealloc,
    .tp_call = delivery_call,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Py_TPFLAGS_HAVE_GC: see the top of this file */
    .tp_doc = "One record's delivery callback (Deliveries.for_record).",
};

static PyObject *deliveries_for_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "for_record(export, topic, st)");
        return NULL;
    }
    Delivery *r = PyObject_New(Delivery, &DeliveryType);
    if (r == NULL) return NULL;
    r->owner = (Deliveries *)Py_NewRef(self);
    r->export = Py_NewRef(args[0]);
    r->topic = Py_NewRef(args[1]);
    r->st = Py_NewRef(args[2]);
    return (PyObject *)r;
}

static PyObject *deliveries_settle(PyObject *self, PyObject *unused) {
    if (settle_run((Deliveries *)self)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *deliveries_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *append, *on_failed, *on_run, *report_type;
    static char *kw[] = {"append", "on_failed", "on_run", "report_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!", kw, &append, &on_failed, &on_run, &PyType_Type,
                                     &report_type))
        return NULL;
    Deliveries *d = (Deliveries *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    int direct = slot_offsets(report_type, RNAMES, R_N, d->off);
    if (direct <= 0) {
        Py_DECREF(d);
        if (direct == 0) /* else the lookup's own error (a MemoryError) stands */
            PyErr_SetString(PyExc_TypeError, "Deliveries: the report type is not a slots dataclass of plain fields");
        return NULL;
    }
    d->append = Py_NewRef(append);
    d->on_failed = Py_NewRef(on_failed);
    d->on_run = Py_NewRef(on_run);
    d->report_type = Py_NewRef(report_type);
    return (PyObject *)d;
}

static int deliveries_traverse(PyObject *self, visitproc visit, void *arg) {
    Deliveries *d = (Deliveries *)self;
    Py_VISIT(d->append);
    Py_VISIT(d->on_failed);
    Py_VISIT(d->on_run);
    Py_VISIT(d->report_type);
    Py_VISIT(d->run_topic);
    Py_VISIT(d->run_st);
    return 0;
}

static int deliveries_clear(PyObject *self) {
    Deliveries *d = (Deliveries *)self;
    Py_CLEAR(d->append);
    Py_CLEAR(d->on_failed);
    Py_CLEAR(d->on_run);
    Py_CLEAR(d->report_type);
    Py_CLEAR(d->run_topic);
    Py_CLEAR(d->run_st);
    d->run_n = 0;
    return 0;
}

static void deliveries_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    deliveries_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef deliveries_methods[] = {
    {"for_record", (PyCFunction)(void (*)(void))deliveries_for_record, METH_FASTCALL,
     "for_record(export, topic, st): the on_delivery callable of one record."},
    {"settle", deliveries_settle, METH_NOARGS, "settle(): hand the delivered records' accounting so far to on_run."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DeliveriesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flow_exporter._native.Deliveries",
    .tp_basicsize = sizeof(Deliveries),
    .tp_dealloc = deliveries_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = deliveries_traverse,
    .tp_clear = deliveries_clear,
    .tp_methods = deliveries_methods,
    .tp_new = deliveries_new,
    .tp_doc = "Delivery reports of one sink (see flow_exporter/_delivery.c).",
};

/*
 * produce_run(exports, start, produce, for_record, topics, refused) -> (stop, count, size, st, error, slow)
 *
 * sink.kafka.KafkaSink.produce_all's loop from `start`, for one run of records to one topic: each record
 * prepared (value and topic set) whose topic the sink knows (`topics`: name -> TopicHealth) is handed to
 * `produce(topic, value, key, on_delivery=for_record(export, topic, st))`. It stops at `stop`: the end of the
 * batch, or a record of another topic (the caller adds this run's `count` records and `size` bytes to `st`'s
 * accounting and calls again from there), or a record for the full path (`slow`: not prepared, an unknown
 * topic, or a produce that raised one of `refused`, BufferError and KafkaException; nothing was queued), or a
 * produce that raised anything else (`error`, the exception: the caller stops the batch there).
 */
enum { P_VALUE, P_TOPIC, P_KEY, P_N };
static const char *const PNAMES[P_N] = {"value", "topic", "key"};
static SlotCache p_slots;

/* The exception raised, taken as produce_run's `error` (never NULL: None if none was set). */
static PyObject *taken_error(void) {
    PyObject *type, *error, *tb;
    PyErr_Fetch(&type, &error, &tb);
    PyErr_NormalizeException(&type, &error, &tb);
    if (error != NULL && tb != NULL) PyException_SetTraceback(error, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return error != NULL ? error : Py_NewRef(Py_None);
}

PyObject *native_produce_run(PyObject *self, PyObject *args) {
    PyObject *exports, *produce, *for_record, *topics, *refused;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "O!nOOO!O", &PyList_Type, &exports, &i, &produce, &for_record, &PyDict_Type, &topics,
                          &refused))
        return NULL;
    static PyObject *kwnames = NULL;
    if (kwnames == NULL && (kwnames = Py_BuildValue("(s)", "on_delivery")) == NULL) return NULL;
    PyObject *run_st = NULL, *error = NULL;
    Py_ssize_t count = 0, size = 0;
    int slow = 0;
    for (; i < PyList_GET_SIZE(exports); i++) {
        PyObject *e = PyList_GET_ITEM(exports, i);
        int direct = slot_cache(&p_slots, (PyObject *)Py_TYPE(e), PNAMES, P_N);
        if (direct < 0) { /* the type's lookup failed: this record's error, after the run so far is counted */
            error = taken_error();
            break;
        }
        if (!direct) {
            slow = 1;
            break;
        }
        PyObject *value = SLOT_AT(p_slots, e, P_VALUE);
        PyObject *topic = SLOT_AT(p_slots, e, P_TOPIC);
        PyObject *key = SLOT_AT(p_slots, e, P_KEY);
        PyObject *st = topic == NULL || topic == Py_None ? NULL : PyDict_GetItemWithError(topics, topic);
        if (st == NULL && PyErr_Occurred()) goto fail;
        if (value == NULL || value == Py_None || st == NULL || key == NULL) {
            slow = 1;
            break;
        }
        if (run_st != NULL && st != run_st) break; /* the next run */
        Py_ssize_t len = PyObject_Length(value);
        if (len < 0) {
            PyErr_Clear();
            slow = 1;
            break;
        }
        Py_INCREF(e); /* produce may run Python code (its logger, say): keep the record and its fields alive */
        Py_INCREF(st);
        PyObject *fr[3] = {e, topic, st};
        PyObject *callback = PyObject_Vectorcall(for_record, fr, 3, NULL);
        PyObject *res = NULL;
        if (callback != NULL) {
            PyObject *pa[4] = {topic, value, key, callback};
            res = PyObject_Vectorcall(produce, pa, 3, kwnames);
            Py_DECREF(callback);
        }
        Py_DECREF(e);
        if (res == NULL) {
            Py_DECREF(st);
            if (PyErr_ExceptionMatches(refused)) {
                PyErr_Clear();
                slow = 1;
                break;
            }
            error = taken_error();
            break;
        }
        Py_DECREF(res);
        if (run_st == NULL) run_st = st;
        else Py_DECREF(st);
        count++;
        size += len;
    }
    PyObject *out = Py_BuildValue("(nnnOOO)", i, count, size, run_st ? run_st : Py_None, error ? error : Py_None,
                                  slow ? Py_True : Py_False);
    Py_XDECREF(run_st);
    Py_XDECREF(error);
    return out;
fail:
    Py_XDECREF(run_st);
    return NULL;
}

int delivery_add_types(PyObject *module) {
    if (PyType_Ready(&DeliveryType) < 0 || PyType_Ready(&DeliveriesType) < 0) return -1;
    Py_INCREF(&DeliveriesType);
    if (PyModule_AddObject(module, "Deliveries", (PyObject *)&DeliveriesType) < 0) {
        Py_DECREF(&DeliveriesType);
        return -1;
    }
    return 0;
}
