// Division of non-negative 31-bit integers by a divisor fixed on the host (ring size, SWA page size):
// a multiply-high, an add and a shift instead of the GPU's ~15-instruction division sequence; and a
// divisibility test of any uint32 by such a divisor. Shared by host and device so that both compute
// the same results.
#pragma once

#include <cstdint>

#include "dsv4/kv_layout.cuh"

namespace dsv4 {

// floor(n / d) for 0 <= n < 2^31 and 1 <= d < 2^31 as (mulhi(m, n) + n) >> l, with l = ceil(log2 d) and
// m = floor(2^32 (2^l - d) / d) + 1. (2^32 + m) / 2^(32+l) exceeds 1/d by less than 1/(d 2^32), too
// little to carry any n < 2^32 past the next multiple of d (Granlund & Montgomery 1994, Thm 4.2), and
// mulhi(m, n) < n keeps the sum below 2^32 for n < 2^31.
struct Divider {
  uint32_t divisor, multiplier, shift;

  DSV4_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(multiplier, n);
#else
    const uint32_t high = uint32_t((uint64_t(multiplier) * n) >> 32);
#endif
    return (high + n) >> shift;
  }

  DSV4_HD uint32_t mod(uint32_t n) const { return n - div(n) * divisor; }
};

// Host side, once per call: d in [1, 2^31).
inline Divider make_divider(uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;
  const uint64_t m = ((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1;
  return Divider{d, uint32_t(m), l};
}

// Whether d divides n, for any uint32 n and a divisor d in [1, 2^32) fixed on the host: a multiply, a
// rotation and a compare. With d = d_odd * 2^shift and inverse = d_odd^-1 mod 2^32, n -> rotr(n * inverse,
// shift) is a bijection of uint32 that maps each multiple k * d (k <= max_quotient = floor((2^32 - 1) / d))
// to k: k * d * inverse = k * 2^shift mod 2^32, and k * 2^shift < 2^32. So exactly the multiples land at
// or below max_quotient.
struct DivisibilityTest {
  uint32_t inverse, shift, max_quotient;

  DSV4_HD bool divides(uint32_t n) const {
    const uint32_t product = n * inverse;
#if defined(__CUDA_ARCH__)
    const uint32_t rotated = __funnelshift_r(product, product, shift);
#else
    const uint32_t rotated = shift == 0 ? product : (product >> shift) | (product << (32 - shift));
#endif
    return rotated <= max_quotient;
  }
};

// Host side, once per call: d in [1, 2^32).
inline DivisibilityTest make_divisibility_test(uint32_t d) {
  uint32_t shift = 0;
  while ((d >> shift) % 2 == 0) ++shift;
  const uint32_t odd = d >> shift;
  uint32_t inverse = odd;  // correct to 3 bits (odd * odd = 1 mod 8); each Newton step doubles them
  for (int i = 0; i < 4; ++i) inverse *= 2u - odd * inverse;
  return DivisibilityTest{inverse, shift, 0xFFFFFFFFu / d};
}

}  // namespace dsv4
