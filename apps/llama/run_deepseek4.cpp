// kvfuse-llama: the deepseek4 model's runs (DeepSeek4Server).
#include "model_run.hpp"

namespace llama_app {

ModelResult run_deepseek4(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                          const Options& o, const std::filesystem::path& root) {
  return run_model<DeepSeek4Server>(name, runner, workloads, o, root);
}

}  // namespace llama_app
