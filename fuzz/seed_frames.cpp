// Writes one valid frame of each shape into a folder, the fuzzer's starting corpus: a
// LoadRequest with neither leg, each leg alone and both, a KvSave and a StateSave.
// Usage: kvfuse_fuzz_seed_frames <folder>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <kvfuse/bridge/frames.hpp>

namespace {

template <class Value>
bool write(const std::string& folder, const std::string& name, const Value& value) {
  std::vector<std::byte> frame(kvfuse::frame_size(value).length);
  if (!kvfuse::to_bytes(value, frame)) return false;
  std::ofstream out(folder + "/" + name, std::ios::binary);
  out.write(reinterpret_cast<const char*>(frame.data()), static_cast<std::streamsize>(frame.size()));
  return static_cast<bool>(out);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvfuse;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <folder>\n", argv[0]);
    return 2;
  }
  const std::string folder = argv[1];
  LoadRequest neither{LoadKey{RequestId{1}, Generation{2}}, std::nullopt, std::nullopt};
  LoadRequest state_only = neither;
  state_only.state = StateSpec{256, PrefixHash{3}, SlotId{4}, 16, 256};
  LoadRequest kv_only = neither;
  kv_only.kv = KvSpec{0, 512, {PrefixHash{5}, PrefixHash{6}}, {BlockId{7}, BlockId{8}, BlockId{9}}};
  LoadRequest joint = kv_only;
  joint.state = state_only.state;
  const KvSave kv_save{SaveKey{PrefixHash{10}, Generation{11}}, {PrefixHash{12}}, {BlockId{13}, BlockId{14}}};
  const StateSave state_save{SaveKey{PrefixHash{15}, Generation{16}}, SlotId{17}, 256};
  const bool ok = write(folder, "load_neither", neither) && write(folder, "load_state_only", state_only) &&
                  write(folder, "load_kv_only", kv_only) && write(folder, "load_joint", joint) &&
                  write(folder, "kv_save", kv_save) && write(folder, "state_save", state_save);
  if (!ok) std::fprintf(stderr, "%s: could not write the seeds into %s\n", argv[0], folder.c_str());
  return ok ? 0 : 1;
}
