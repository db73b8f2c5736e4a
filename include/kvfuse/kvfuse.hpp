// kvfuse/kvfuse.hpp — everything an engine needs, in one include. HipRuntime is separate
// (<kvfuse/device/hip_runtime.hpp>) because it needs the HIP headers and library.
#pragma once

#include <kvfuse/error.hpp>
#include <kvfuse/engine/ids.hpp>
#include <kvfuse/engine/load_request.hpp>
#include <kvfuse/completion/records.hpp>
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/tier/tier.hpp>
