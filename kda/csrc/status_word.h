// The device's error word for malformed CUDA cu_seqlens (status_word.cu); plain C++ for the binding.
#pragma once

#include <cstdint>

namespace kda {

// The word's value while no malformed boundary was seen (the boundary check lowers it atomically).
constexpr unsigned long long kStatusClear = 1ull << 62;

// Allocates and clears the word of CUDA device `device` (not during graph capture); returns its address.
std::uintptr_t status_word_create(int device);

// Waits for all work on `device` (every stream), then atomically reads and resets the word; returns what it held
// (kStatusClear: nothing malformed since the last take).
uint64_t status_word_take(std::uintptr_t address, int device);

}  // namespace kda
