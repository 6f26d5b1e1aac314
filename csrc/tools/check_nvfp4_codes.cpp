// Exhaustive checks of the NVFP4 encoder's division-free paths (sparkinfer/records.h) against the
// spec's arithmetic, an fp32 division and the E2M1 thresholds compared one by one:
//   1. e2m1_biased: the code of every fp32 a in [0, 6];
//   2. e2m1_codes8 with divisor: for every divisor mantissa m1 in [1, 2), the codes of x / m1 for
//      every x within 6 ulps of each E2M1 boundary t times m1 (the only x whose code the quotient's
//      last bit can change), both signs;
//   3. rcp_rn: 1 / m for every fp32 m in [2**-22, 4) (divisor's m1), equal to the IEEE division;
//   4. nvfp4_token_scale and nvfp4_rope_scale: for every non-negative fp32 a (infinity and NaN
//      included), bit-equal to max(a / 2688, 2**-126) and max(a / 448, 2**-126);
//   5. quotient: for every divisor mantissa D in [1, 2), x within 6 ulps of (1 + k / 16) D, k < 16
//      (every E4M3 rounding boundary's mantissa, the subnormal codes' too), both signs, bit-equal to
//      x / D (a power of two on x or D scales every step exactly, so one binade stands for all that
//      stay normal); and the E4M3 codes of x / D for the special dividends and divisors the encoder
//      meets (0, subnormal, huge, infinite and NaN x; D at 2**-126, past 2**127, infinite).
// Build and run (under a minute in full; STRIDE > 1 samples every STRIDE-th value, as the test does):
//   g++ -O2 -std=c++17 -ffp-contract=off -fno-fast-math -I csrc/include csrc/tools/check_nvfp4_codes.cpp -o check
//   ./check [STRIDE]
#include <stdio.h>
#include <stdlib.h>

#include "sparkinfer/records.h"

namespace {

int spec_code(float q) {  // the spec's E2M1 magnitude of an fp32 quotient, threshold by threshold
  const float a = fabsf(q);
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t stride = argc > 1 ? (uint32_t)atoi(argv[1]) : 1u;
  long checked = 0, bad = 0;
  for (uint32_t b = 0; b <= si::f32_bits(6.0f); b += stride) {
    const float a = si::bits_f32(b);
    ++checked;
    if ((int)si::e2m1_magnitude(a) != spec_code(a) && bad++ < 5) printf("e2m1 a=%a\n", a);
  }
  const float t[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (uint32_t mm = 0; mm < (1u << 23); mm += stride) {
    const float m = si::bits_f32(0x3f800000u | mm);
    const si::Divisor d = si::divisor(m);
    for (int k = 0; k < 7; ++k) {
      float x[8];
      for (int u = -6; u <= 6; u += 2) {  // a word: u and u + 1 ulps from RN(t m), both signs
        for (int i = 0; i < 8; ++i) {
          const int off = u + (i % 2);
          x[i] = si::bits_f32(si::f32_bits(t[k] * m) + off) * (i < 4 ? 1.0f : -1.0f);
        }
        const uint32_t w = si::e2m1_codes8(x, d);
        for (int i = 0; i < 8; ++i) {
          const int c = spec_code(x[i] / m);
          const uint32_t want = (uint32_t)(c != 0 && x[i] < 0.0f ? c | 8 : c);
          ++checked;
          if (((w >> (4 * i)) & 15u) != want && bad++ < 10) printf("quotient m=%a x=%a\n", m, x[i]);
        }
      }
    }
  }
  for (uint32_t b = si::f32_bits(0x1p-22f); b < si::f32_bits(4.0f); b += stride) {
    const float m = si::bits_f32(b);
    ++checked;
    if (si::f32_bits(si::rcp_rn(m)) != si::f32_bits(1.0f / m) && bad++ < 15) printf("rcp m=%a\n", m);
  }
  for (uint32_t b = 0; b <= 0x7fffffffu - stride; b += stride) {  // a >= 0: amax never has a sign
    const float a = si::bits_f32(b);
    checked += 2;
    if (si::f32_bits(si::nvfp4_token_scale(a)) != si::f32_bits(fmaxf(a / 2688.0f, si::kTiny)) && bad++ < 20)
      printf("token scale a=%a\n", a);
    if (si::f32_bits(si::nvfp4_rope_scale(a)) != si::f32_bits(fmaxf(a / 448.0f, si::kTiny)) && bad++ < 25)
      printf("rope scale a=%a\n", a);
  }
  for (uint32_t mm = 0; mm < (1u << 23); mm += stride) {
    const float m = si::bits_f32(0x3f800000u | mm);
    const si::Divisor d = si::divisor(m);
    for (int k = 0; k < 16; ++k) {
      const uint32_t at = si::f32_bits((1.0f + k / 16.0f) * m);
      for (int off = -6; off <= 6; ++off) {
        for (int sg = 0; sg < 2; ++sg) {
          const float x = si::bits_f32(at + off) * (sg ? -1.0f : 1.0f);
          ++checked;
          if (si::f32_bits(si::quotient(x, d)) != si::f32_bits(x / m) && bad++ < 30)
            printf("quotient m=%a x=%a\n", m, x);
        }
      }
    }
  }
  const float xs[] = {0.0f, -0.0f, 0x1p-149f, -0x1p-140f, 0x1p-126f, 1.0f, -3.5f, 448.0f, 0x1p100f, -0x1p127f,
                      3.40282347e38f, -3.40282347e38f, INFINITY, -INFINITY, NAN};
  const float ds[] = {0x1p-126f, 0x1.8p-124f, 1.0f, 0x1.fffffep0f, 2688.0f, 0x1p127f, 0x1.8p127f, 3.40282347e38f,
                      INFINITY};
  for (float x : xs)
    for (float m : ds) {
      ++checked;
      if (si::e4m3_encode(si::quotient(x, si::divisor(m))) != si::e4m3_encode(x / m) && bad++ < 40)
        printf("e4m3 x=%a m=%a\n", x, m);
    }
  printf("%ld checked, %ld wrong\n", checked, bad);
  return bad != 0;
}
