// kvfuse-replay: the hidden mode in which the binary is one rank process (ranks as
// processes, rank_process.hpp). main() calls it for `kvfuse-replay --rank-process FD`.
#pragma once

namespace replay {

/// Serves as one rank process on the control channel `fd` until the engine says quit or is
/// gone: reads the setup, finds its model's entry and runs its serve_rank. Returns the exit
/// status (0, or 3 when it could not start: the reason went back to the engine). Main thread.
int rank_process_main(int fd);

}  // namespace replay
