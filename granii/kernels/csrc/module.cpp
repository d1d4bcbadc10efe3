// The Python module granii._native: importing it loads this library, whose static initialisers
// register every operator of granii/kernels/csrc/*.cpp under torch.ops.granii (each file adds its
// own with TORCH_LIBRARY_FRAGMENT(granii, m)). It defines no Python functions itself, so it needs
// neither pybind11 nor torch/extension.h (both slow to compile).
#include <Python.h>

static struct PyModuleDef granii_native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "granii's native CPU kernels; the operators are under torch.ops.granii.", -1, nullptr};

#define GRANII_STR2(x) #x
#define GRANII_STR(x) GRANII_STR2(x)
#ifndef GRANII_SOURCES_SHA
#define GRANII_SOURCES_SHA hunknown
#endif

// sources_sha: the hash setup.py computed over csrc/ and setup.py (as h<hex>); granii.kernels.native
// compares it with the sources on disk and says when the library is stale.
PyMODINIT_FUNC PyInit__native(void) {
  PyObject* m = PyModule_Create(&granii_native_module);
  if (m != nullptr &&
      PyModule_AddStringConstant(m, "sources_sha", GRANII_STR(GRANII_SOURCES_SHA)) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
