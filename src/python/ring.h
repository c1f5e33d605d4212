// qkv._qkv's ring attention functions (ring.cc), defined where qkv::distributed is built.
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void define_ring(nanobind::module_& m);

}  // namespace qkv::python
