// torch's CPU bernoulli_(p) (dropout's draw), drawing the numbers torch draws, faster.
//
//   granii::bernoulli_(out, p, generator=None) -> out
//       out[i] = 1 if u_i < p else 0,   u_i = ((w[2i] & (2^21 - 1)) 2^32 + w[2i+1]) 2^-53,
//       w the next words of the generator's mt19937 (torch's default generator when None).
//
// This is what torch's serial CPU kernel computes (at::bernoulli_distribution<double> over
// random64(): two words per element, the first the high half of 53 bits), one element at a time
// through the generator's call operator, ~14 ns per element here. This kernel makes the words a
// state block (624) at a time, the twist and the tempering in plain loops the compiler
// vectorises, and compares integers: u < p <=> m < ceil(p 2^53), m = u 2^53 (exact: both are
// multiples of 2^-53 apart from p, and p 2^53 is exact in double). The generator is left in the
// state torch's kernel leaves it in (the same words consumed), so later draws are unchanged.
// Whether the running torch draws this way is checked by the Python side before use
// (granii/kernels/dropout.py): torch builds that take MKL's generator for bernoulli_ do not.
#include "native.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <torch/library.h>

#include <cmath>
#include <mutex>

namespace granii {
namespace {

constexpr int kN = 624;  // at::MERSENNE_STATE_N
constexpr int kM = 397;  // at::MERSENNE_STATE_M

inline uint32_t twist(uint32_t u, uint32_t v) {
  uint32_t y = (u & 0x80000000u) | (v & 0x7fffffffu);
  return (y >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

// The next state block, as at::mt19937's next_state.
void next_block(uint32_t* __restrict st) {
  for (int i = 0; i < kN - kM; ++i) st[i] = st[i + kM] ^ twist(st[i], st[i + 1]);
  for (int i = kN - kM; i < kN - 1; ++i) st[i] = st[i + kM - kN] ^ twist(st[i], st[i + 1]);
  st[kN - 1] = st[kM - 1] ^ twist(st[kN - 1], st[0]);
}

inline uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

template <typename T>
inline T draw(uint32_t hi, uint32_t lo, uint64_t bound) {
  uint64_t m = (static_cast<uint64_t>(hi & 0x1fffffu) << 32) | lo;
  return m < bound ? T(1) : T(0);
}

// Fill out[0, n) consuming 2n words of the engine state `d`, as n calls of random64() would.
// d.left_ - 1 words remain in the current block from d.next_ on; at d.left_ == 1 the next call
// makes a new block and takes its first word.
template <typename T>
void fill(T* __restrict out, int64_t n, double p, at::mt19937_data_pod& d) {
  const uint64_t bound = static_cast<uint64_t>(std::ceil(p * 9007199254740992.0));  // p 2^53
  uint32_t* st = d.state_.data();
  uint32_t words[kN];
  int64_t i = 0;
  bool carry = false;        // a word drawn as the high half of element i, its low half not yet
  uint32_t hi = 0;
  int64_t left = d.left_, next = d.next_;
  while (i < n) {
    if (left == 1) {
      next_block(st);
      left = kN + 1;
      next = 0;
    }
    int64_t want = 2 * (n - i) - (carry ? 1 : 0);
    int64_t take = std::min<int64_t>(left - 1, want);
    const uint32_t* src = st + next;
    for (int64_t k = 0; k < take; ++k) words[k] = temper(src[k]);
    int64_t k = 0;
    if (carry) {
      out[i++] = draw<T>(hi, words[0], bound);
      k = 1;
      carry = false;
    }
    int64_t pairs = (take - k) / 2;
    T* o = out + i;
    const uint32_t* w = words + k;
    for (int64_t j = 0; j < pairs; ++j) o[j] = draw<T>(w[2 * j], w[2 * j + 1], bound);
    i += pairs;
    k += 2 * pairs;
    if (k < take) {
      hi = words[k];
      carry = true;
    }
    next += take;
    left -= take;
  }
  d.left_ = static_cast<int>(left);
  d.next_ = static_cast<uint32_t>(next);
}

at::Tensor& bernoulli_(at::Tensor& out, double p, const c10::optional<at::Generator>& generator) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble),
              "granii::bernoulli_: out must be a contiguous float32 or float64 CPU tensor");
  TORCH_CHECK(p >= 0 && p <= 1, "granii::bernoulli_: p must be in [0, 1], not ", p);
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      generator, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::mt19937_data_pod d = gen->engine().data();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "granii::bernoulli_", [&] {
    fill<scalar_t>(out.data_ptr<scalar_t>(), out.numel(), p, d);
  });
  at::mt19937 engine;
  engine.set_data(d);
  gen->set_engine(engine);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("bernoulli_(Tensor(a!) out, float p, Generator? generator=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) { m.impl("bernoulli_", &bernoulli_); }

}  // namespace granii
