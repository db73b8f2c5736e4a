// kvfuse/version.hpp — the library's version, in one place. CMake reads it from here
// (project(VERSION ...)), so the package version and the headers never disagree.
#pragma once

#define KVFUSE_VERSION_MAJOR 0
#define KVFUSE_VERSION_MINOR 2
#define KVFUSE_VERSION_PATCH 0

/// major * 10000 + minor * 100 + patch, for preprocessor comparisons.
#define KVFUSE_VERSION (KVFUSE_VERSION_MAJOR * 10000 + KVFUSE_VERSION_MINOR * 100 + KVFUSE_VERSION_PATCH)
