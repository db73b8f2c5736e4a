// slot_progress.hpp — what kvfuse-llama-server's backend knows about one of llama-server's
// slots between its hooks: how far the slot's cells are what a prefill from token 0
// computes, and where the current prompt stands. Plain data; llama-server's main loop.
#pragma once

#include <optional>

#include <kvfuse/kvfuse.hpp>

namespace kvfuse::llama_server {

/// What the backend knows about one slot. Plain data.
struct SlotProgress {
  TokenCount clean = 0;        ///< leading cells that are what a prefill from token 0 computes
  TokenCount restored = 0;     ///< this task: tokens restored from kvfuse (0: none)
  TokenCount prompt = 0;       ///< this task's prompt length
  TokenCount tail = 0;         ///< the server's own split of the prompt's last tokens
  std::optional<TokenCount> start;  ///< where this task's prefill started (its first computed())
  bool grid = false;           ///< the prefill started on the grid from clean cells
  bool open = false;           ///< a task between load() and its prompt's end
  bool settle = false;         ///< a served prompt ended: settle() may recompute what followed it
  TokenCount state_at = 0;     ///< a stateful sequence: the last boundary whose state kvfuse holds
  TokenCount state_end = 0;    ///< a stateful sequence that settle() left clean to its end: that end (0: none)
};

}  // namespace kvfuse::llama_server
