// A malloc'd copy of a C++ string, for messages and tables handed to Rust (freed there with
// `free`, through rlhf_aten_free_string or the graph library's own free). Shared by the files of
// this crate's two libraries.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

inline char* rlhf_dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, s.c_str(), s.size() + 1);
  }
  return out;
}
