// qkv._qkv's training pieces (layers.cc): EncoderLayer with its tape, cross_entropy, AdamW.
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void define_layers(nanobind::module_& m);

}  // namespace qkv::python
