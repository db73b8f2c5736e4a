// A tiny engine that includes kvfuse the way any engine would, to prove the package works
// both installed (find_package) and vendored (add_subdirectory).
#include <kvfuse/kvfuse.hpp>

#include <cstdio>

int main() {
  kvfuse::GenerationSource generations;
  const kvfuse::LoadKey key{kvfuse::RequestId{7}, generations.next()};
  const kvfuse::TokenGrid grid = kvfuse::TokenGrid::make(256);
  if (grid.ceil(300) != 512 || key.generation.value != 1) return 1;
  std::printf("consumer ok: %s\n", kvfuse::to_string(key).c_str());
  return 0;
}
