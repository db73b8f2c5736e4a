// kvfuse-llama: the kimi-k3 model's runs (KimiK3Server).
#include "model_run.hpp"

namespace llama_app {

ModelResult run_kimi_k3(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                        const Options& o, const std::filesystem::path& root) {
  return run_model<KimiK3Server>(name, runner, workloads, o, root);
}

}  // namespace llama_app
