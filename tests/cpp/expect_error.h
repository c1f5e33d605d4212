// Shared test helper: run a body that must throw qkv::Error with a given message fragment.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "qkv/error.h"

namespace qkv::testing {

// Runs `body`, which must throw qkv::Error with a message containing `expected`.
template <typename Body>
void expect_error(Body&& body, const std::string& expected) {
  try {
    body();
    ADD_FAILURE() << "no error; expected one containing: " << expected;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos)
        << "message: " << error.what() << "\nexpected to contain: " << expected;
  }
}

}  // namespace qkv::testing
