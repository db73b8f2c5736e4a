// kvfuse-replay: one pass (pass_loop.hpp, pass_admission.hpp), for ranks as threads (the
// group is a TpQuorum) or as processes (a ShmQuorum over the segment).
#include "pass.hpp"

#include "pass_admission.hpp"
#include "pass_loop.hpp"

namespace replay {

RunResult replay_pass(const Model& model, const Workload& w, const RunOptions& options) {
  if (options.ranks_as == RanksAs::processes) return pass_detail::Pass<kvfuse::ShmQuorum>(model, w, options).run();
  return pass_detail::Pass<kvfuse::TpQuorum>(model, w, options).run();
}

}  // namespace replay
