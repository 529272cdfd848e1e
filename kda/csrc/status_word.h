// The device's error word for malformed CUDA cu_seqlens and state_indices (status_word.cu); plain C++ for the
// binding.
#pragma once

#include <cstdint>

namespace kda {

// The word's value while no malformed boundary was seen (the boundary check lowers it atomically).
constexpr unsigned long long kStatusClear = 1ull << 62;

// The word's code of a state index outside the pool (sequence n): kStatusStateIndexBase + n, above every cu_seqlens
// index, so the word still names the first malformed cu_seqlens boundary when there is one (the smallest code
// wins; flash_kda.last_error decodes both).
constexpr unsigned long long kStatusStateIndexBase = 1ull << 40;
// The code of a checkpoint_indices entry outside the pool (sequence n), above the state indices' codes.
constexpr unsigned long long kStatusCheckpointIndexBase = 1ull << 41;

// Allocates and clears the word of CUDA device `device` (not during graph capture); returns its address.
std::uintptr_t status_word_create(int device);

// Waits for all work on `device` (every stream), then atomically reads and resets the word; returns what it held
// (kStatusClear: nothing malformed since the last take).
uint64_t status_word_take(std::uintptr_t address, int device);

}  // namespace kda
