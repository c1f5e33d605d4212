// Argument conversions the bindings share (module.cc, ring.cc, layers.cc): choices given as
// strings, and key lengths given as an integer array; and how they call the library.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "qkv/attention.h"
#include "qkv/error.h"

namespace qkv::python {

namespace nb = nanobind;

// `value` looked up in `choices`; else ValueError "name: expected 'a', 'b' or 'c', got 'x'".
template <typename T>
T parse_choice(const char* name, const std::string& value,
               std::initializer_list<std::pair<const char*, T>> choices) {
  std::string expected;
  std::size_t index = 0;
  for (const auto& [text, choice] : choices) {
    if (value == text) return choice;
    expected += (index == 0                    ? "'"
                 : index + 1 == choices.size() ? " or '"
                                               : ", '") +
                std::string(text) + "'";
    ++index;
  }
  throw nb::value_error(
      (std::string(name) + ": expected " + expected + ", got '" + value + "'").c_str());
}

// Runs `call` without the GIL (other Python threads run meanwhile) and returns its result;
// qkv::Error becomes ValueError.
template <typename Call>
auto without_gil(Call&& call) {
  try {
    nb::gil_scoped_release release;
    return call();
  } catch (const Error& error) {
    throw nb::value_error(error.what());
  }
}

// "bottom_right" or "top_left" (the CLI's spellings, "bottom-right", are taken too).
Align parse_align(const std::string& align);
// "auto", "reference", "chunked" or "flash".
Kernel parse_kernel(const std::string& kernel);
// None -> {}; else a (B,) int32 or int64 array.
std::vector<std::int64_t> key_lengths_of(nb::handle key_lengths);

}  // namespace qkv::python
