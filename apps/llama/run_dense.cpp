// kvfuse-llama: the llama model's runs (DenseServer).
#include "model_run.hpp"

namespace llama_app {

ModelResult run_dense(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                      const Options& o, const std::filesystem::path& root) {
  return run_model<DenseServer>(name, runner, workloads, o, root);
}

}  // namespace llama_app
