// kvfuse's applications (kvfuse-replay, kvfuse-llama): the command line's end, written once.
// Every application answers --help on stdout with status 0, and a usage error on stderr as
// "PROGRAM: what is wrong", a blank line and the usage, with status 2.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace kvfuse_apps {

/// Prints "`program`: `message`", a blank line and `app`'s usage to stderr; returns 2, the
/// exit status of a usage error. Main thread.
inline int usage_error(const CLI::App& app, std::string_view program, const std::string& message) {
  std::fprintf(stderr, "%.*s: %s\n\n%s", static_cast<int>(program.size()), program.data(), message.c_str(),
               app.help().c_str());
  return 2;
}

/// Parses `argv` into `app`'s options. Returns the exit status when the run ends here (0:
/// --help printed; 2: a usage error printed, as usage_error does), or nothing when the run
/// goes on. Main thread.
inline std::optional<int> parse_or_usage(CLI::App& app, std::string_view program, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(app, program, e.what());
  }
  return std::nullopt;
}

}  // namespace kvfuse_apps
