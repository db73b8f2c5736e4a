// kvfuse-replay: one rank process's entry (rank_process_main.hpp): the setup, the model it
// names, that entry's serve_rank. The only file of the rank process's side that knows the
// model table; the table instantiates serve_rank from rank_server.hpp, which knows no model.
#include "rank_process_main.hpp"

#include "child_setup.hpp"
#include "control_channel.hpp"
#include "models.hpp"

#include <exception>
#include <span>
#include <string>
#include <vector>

namespace replay {

int rank_process_main(int fd) {
  ControlChannel channel(fd);
  ControlHeader h;
  std::vector<std::byte> payload;
  if (!channel.get(h, payload) || h.op != ControlOp::ready) return 3;
  auto refuse = [&](const std::string& why) {
    const auto* b = reinterpret_cast<const std::byte*>(why.data());
    (void)channel.put({ControlOp::ready, 0, 0}, std::span<const std::byte>(b, why.size()));
    return 3;
  };
  try {
    const ChildSetup s = ChildSetup::decode(payload);
    const Model* m = find_model(s.model);
    if (m == nullptr || m->serve_rank == nullptr) return refuse("no model \"" + s.model + "\"");
    return m->serve_rank(s, channel);
  } catch (const std::exception& e) {
    return refuse(e.what());
  }
}

}  // namespace replay
