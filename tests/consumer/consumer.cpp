// A tiny engine that includes kvfuse the way any engine would, to prove the package works
// both installed (find_package) and vendored (add_subdirectory).
#include <kvfuse/kvfuse.hpp>

#include <cstdio>

#ifdef KVFUSE_PACKAGE_VERSION_MAJOR  // the find_package consumer passes the package's version
static_assert(KVFUSE_VERSION_MAJOR == KVFUSE_PACKAGE_VERSION_MAJOR && KVFUSE_VERSION_MINOR == KVFUSE_PACKAGE_VERSION_MINOR &&
                  KVFUSE_VERSION_PATCH == KVFUSE_PACKAGE_VERSION_PATCH,
              "the CMake package version and <kvfuse/version.hpp> disagree");
#endif

int main() {
  kvfuse::GenerationSource generations;
  const kvfuse::LoadKey key{kvfuse::RequestId{7}, generations.next()};
  const kvfuse::TokenGrid grid = kvfuse::TokenGrid::make(256);
  if (grid.ceil(300) != 512 || key.generation.value != 1) return 1;
  std::printf("consumer ok: kvfuse %d.%d.%d, %s\n", KVFUSE_VERSION_MAJOR, KVFUSE_VERSION_MINOR, KVFUSE_VERSION_PATCH,
              kvfuse::to_string(key).c_str());
  return 0;
}
