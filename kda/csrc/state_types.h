// The caller's initial and final state dtypes as types, for the launchers that instantiate a kernel per pair.
#pragma once

#include <cuda_bf16.h>

#include "kda/csrc/kda_params.h"

namespace kda {

// The caller's initial and final state dtypes as types: launch(StateType<InitT>{}, StateType<FinalT>{}).
template <typename T>
struct StateType {
  using type = T;
};
template <typename Launch>
void with_state_types(const FwdParams& p, Launch launch) {
  auto with_final = [&](auto init) {
    if (p.final_is_fp32) return launch(init, StateType<float>{});
    return launch(init, StateType<__nv_bfloat16>{});
  };
  if (p.initial_is_fp32) return with_final(StateType<float>{});
  return with_final(StateType<__nv_bfloat16>{});
}

}  // namespace kda
