#include "tools/cli.h"

#include <cerrno>
#include <cstdlib>

namespace qkv::cli {

std::string Args::value(const std::string& name) {
  if (done()) throw UsageError(name + ": missing value");
  return next();
}

std::int64_t parse_int(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
    throw UsageError(option + ": expected an integer, got '" + text + "'");
  }
  return value;
}

double parse_double(const std::string& option, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE) {
    throw UsageError(option + ": expected a number, got '" + text + "'");
  }
  return value;
}

Layout parse_layout(const std::string& text) {
  if (text == "bshd") return Layout::kBSHD;
  if (text == "bhsd") return Layout::kBHSD;
  throw UsageError("--layout: expected bshd or bhsd, got '" + text + "'");
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> items;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

std::vector<std::int64_t> parse_int_list(const std::string& option, const std::string& text) {
  std::vector<std::int64_t> values;
  for (const std::string& item : split_commas(text)) values.push_back(parse_int(option, item));
  return values;
}

}  // namespace qkv::cli
