/* The sequences of a shared-prompt group as int32/float64 bytes: GroupColumns.add_shared_prompt's inner loop.
 *
 * A datagen group is 8 one-reply sequences, each `prompt + output`, the prompt masked with -100 and given
 * logprob 1.0. In Python (array('i', list) per output, four array concatenations per sequence) that cost ~10 us
 * of a worker's ~150 us of CPU per group (bench/RESULTS.md, issue 33); here it is one call and one pass.
 *
 * Values are converted exactly as array('i') and array('d') convert them (the Python path, kept as the fallback
 * and checked against this one in tests/unit/tasks/test_group_columns.py): ids through __index__, a float refused
 * with TypeError, an id outside int32 refused with OverflowError; logprobs through PyFloat_AsDouble. On any such
 * error nothing is returned and the caller leaves the group to the general path.
 *
 * Built at install time by setup.py as the optional extension `factory._group_arrays`; where it was not built,
 * factory/group_columns.py uses the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define MASK_IGNORE (-100)

/* One value as array('i') stores it; -1 with an exception set on failure (callers check PyErr_Occurred). */
static int to_int32(PyObject *value, int32_t *out)
{
    long x;
    if (PyLong_CheckExact(value)) {
        x = PyLong_AsLong(value);
    } else {
        if (PyFloat_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "array item must be integer");
            return -1;
        }
        Py_INCREF(value); /* __index__ may run Python code that changes the list */
        x = PyLong_AsLong(value);
        Py_DECREF(value);
    }
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (x > INT32_MAX || x < INT32_MIN) {
        PyErr_SetString(PyExc_OverflowError, x > 0 ? "signed integer is greater than maximum"
                                                  : "signed integer is less than minimum");
        return -1;
    }
    *out = (int32_t)x;
    return 0;
}

/* The `count` ids of `list` into `out`; the list must still hold `count` items after each conversion. */
static int put_ids(PyObject *list, Py_ssize_t count, int32_t *out)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyList_GET_SIZE(list) != count) {
            PyErr_SetString(PyExc_TypeError, "a token id list changed while it was read");
            return -1;
        }
        if (to_int32(PyList_GET_ITEM(list, i), &out[i]) < 0)
            return -1;
    }
    return 0;
}

static int put_floats(PyObject *values, Py_ssize_t count, double *out)
{
    PyObject *fast = PySequence_Fast(values, "logprobs must be a sequence");
    if (fast == NULL)
        return -1;
    int failed = 0;
    if (PySequence_Fast_GET_SIZE(fast) != count) {
        PyErr_SetString(PyExc_TypeError, "logprobs do not line up with their output");
        failed = 1;
    }
    for (Py_ssize_t i = 0; !failed && i < count; i++) {
        PyObject *value = PySequence_Fast_GET_ITEM(fast, i);
        Py_INCREF(value);
        double x = PyFloat_AsDouble(value);
        Py_DECREF(value);
        if (x == -1.0 && PyErr_Occurred())
            failed = 1;
        out[i] = x;
    }
    Py_DECREF(fast);
    return failed ? -1 : 0;
}

PyDoc_STRVAR(shared_prompt_sequences_doc,
"shared_prompt_sequences(prompt, outputs, logprobs) -> (tokens, masks, lengths, logprobs)\n\n"
"prompt: list of ids; outputs: lists of ids; logprobs: None or one sequence of floats per output. Returns bytes:\n"
"each output's `prompt + output` ids (int32), masks (the prompt as -100, then the output), lengths (int32, one\n"
"per output), and the logprobs (float64: 1.0 per prompt position, then the output's), or None for None.\n"
"TypeError or OverflowError, as array('i') and array('d') raise them, for a value they would refuse.");

static PyObject *shared_prompt_sequences(PyObject *module, PyObject *args)
{
    PyObject *prompt, *outputs, *logprobs;
    if (!PyArg_ParseTuple(args, "O!O!O:shared_prompt_sequences", &PyList_Type, &prompt, &PyList_Type, &outputs,
                          &logprobs))
        return NULL;
    const Py_ssize_t width = PyList_GET_SIZE(prompt), count = PyList_GET_SIZE(outputs);
    if (logprobs != Py_None && (!PyList_Check(logprobs) || PyList_GET_SIZE(logprobs) != count)) {
        PyErr_SetString(PyExc_TypeError, "logprobs must be None or a list with one entry per output");
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *output = PyList_GET_ITEM(outputs, i);
        if (!PyList_Check(output)) {
            PyErr_SetString(PyExc_TypeError, "each output must be a list of token ids");
            return NULL;
        }
        total += width + PyList_GET_SIZE(output);
    }
    PyObject *tokens = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(int32_t));
    PyObject *masks = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(int32_t));
    PyObject *lengths = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int32_t));
    PyObject *floats = logprobs == Py_None ? Py_NewRef(Py_None)
                                           : PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(double));
    int32_t *prompt_ids = PyMem_Malloc((width ? width : 1) * sizeof(int32_t));
    if (tokens == NULL || masks == NULL || lengths == NULL || floats == NULL || prompt_ids == NULL) {
        if (prompt_ids == NULL)
            PyErr_NoMemory();
        goto fail;
    }
    if (put_ids(prompt, width, prompt_ids) < 0)
        goto fail;
    int32_t *t = (int32_t *)PyBytes_AS_STRING(tokens), *m = (int32_t *)PyBytes_AS_STRING(masks);
    int32_t *lengths_out = (int32_t *)PyBytes_AS_STRING(lengths);
    double *f = floats == Py_None ? NULL : (double *)PyBytes_AS_STRING(floats);
    Py_ssize_t written = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyList_GET_SIZE(outputs) != count) { /* __index__ or __float__ may run code that changes the lists */
            PyErr_SetString(PyExc_TypeError, "the outputs changed while they were read");
            goto fail;
        }
        PyObject *output = PyList_GET_ITEM(outputs, i);
        const Py_ssize_t size = PyList_Check(output) ? PyList_GET_SIZE(output) : -1;
        if (size < 0 || written + width + size > total) {
            PyErr_SetString(PyExc_TypeError, "the outputs changed while they were read");
            goto fail;
        }
        memcpy(t + written, prompt_ids, width * sizeof(int32_t));
        for (Py_ssize_t j = 0; j < width; j++)
            m[written + j] = MASK_IGNORE;
        Py_INCREF(output);
        int failed = put_ids(output, size, t + written + width);
        Py_DECREF(output);
        if (failed)
            goto fail;
        memcpy(m + written + width, t + written + width, size * sizeof(int32_t));
        if (f != NULL) {
            for (Py_ssize_t j = 0; j < width; j++)
                f[written + j] = 1.0;
            if (PyList_GET_SIZE(logprobs) != count) {
                PyErr_SetString(PyExc_TypeError, "the logprobs changed while they were read");
                goto fail;
            }
            PyObject *values = PyList_GET_ITEM(logprobs, i);
            Py_INCREF(values);
            failed = put_floats(values, size, f + written + width);
            Py_DECREF(values);
            if (failed)
                goto fail;
        }
        if (width + size > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "a sequence longer than int32 allows");
            goto fail;
        }
        lengths_out[i] = (int32_t)(width + size);
        written += width + size;
    }
    if (written != total) {
        PyErr_SetString(PyExc_TypeError, "a token id list changed while it was read");
        goto fail;
    }
    PyMem_Free(prompt_ids);
    return Py_BuildValue("(NNNN)", tokens, masks, lengths, floats);
fail:
    PyMem_Free(prompt_ids);
    Py_XDECREF(tokens);
    Py_XDECREF(masks);
    Py_XDECREF(lengths);
    Py_XDECREF(floats);
    return NULL;
}

static PyMethodDef methods[] = {
    {"shared_prompt_sequences", shared_prompt_sequences, METH_VARARGS, shared_prompt_sequences_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "factory._group_arrays",
    "A shared-prompt group's sequences as int32/float64 bytes (see group_arrays.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__group_arrays(void)
{
    return PyModule_Create(&module);
}
