// check_written_disjoint (overlap_checks.h): each tensor's bytes are described as `rows` runs of `width` bytes,
// `stride` bytes apart, and two such descriptions are intersected exactly with integer arithmetic.
#include "overlap_checks.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "op_checks.h"

namespace dsv4 {

namespace {

// The bytes of a tensor: runs r = 0 .. rows-1 cover [begin + r * stride, begin + r * stride + width).
// stride > width when rows > 1 (otherwise the runs would join into one).
struct ByteRuns {
  int64_t begin = 0;
  int64_t rows = 0;  // 0: the tensor has no bytes
  int64_t width = 0;
  int64_t stride = 0;
  int64_t end() const { return begin + (rows - 1) * stride + width; }
};

int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

constexpr size_t kMaxDims = 16;  // more dimensions that move through memory: not checked

// nullopt when the bytes are not equally spaced runs; no runs for an absent or empty tensor.
std::optional<ByteRuns> byte_runs(const Tensor* t) {
  ByteRuns runs;
  if (t == nullptr || t->numel() == 0) return runs;
  const int64_t element = static_cast<int64_t>(t->element_size());
  const auto sizes = t->sizes();
  const auto strides = t->strides();
  // (size, byte stride) of every dimension that moves through memory, innermost first.
  std::array<std::pair<int64_t, int64_t>, kMaxDims> dims;
  size_t count = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1 || strides[d] == 0) continue;  // a broadcast dimension repeats the same bytes
    if (strides[d] < 0 || count == kMaxDims) return std::nullopt;
    dims[count++] = {sizes[d], strides[d] * element};
  }
  std::sort(dims.begin(), dims.begin() + count, [](const auto& a, const auto& b) { return a.second < b.second; });
  // Copies of a dense run shifted by at most its width form one longer dense run.
  int64_t width = element;
  size_t next = 0;
  for (; next < count && dims[next].second <= width; ++next)
    width += (dims[next].first - 1) * dims[next].second;
  runs.begin = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->data_ptr()));
  runs.width = width;
  runs.rows = 1;
  runs.stride = width;
  if (next == count) return runs;
  runs.rows = dims[next].first;
  runs.stride = dims[next].second;
  // Further dimensions that continue the same spacing ([a, b] with stride(0) == b * stride(1)) add rows.
  for (++next; next < count; ++next) {
    if (dims[next].second != runs.rows * runs.stride) return std::nullopt;
    runs.rows *= dims[next].first;
  }
  return runs;
}

// The index of the first run of `t` that ends after byte `lo`.
int64_t first_run_ending_after(const ByteRuns& t, int64_t lo) {
  return lo < t.begin + t.width ? 0 : (lo - t.begin - t.width) / t.stride + 1;
}

// Whether a run of `t` shares a byte with [lo, hi).
bool touches(const ByteRuns& t, int64_t lo, int64_t hi) {
  const int64_t first = first_run_ending_after(t, lo);
  return first < t.rows && t.begin + first * t.stride < hi;
}

bool overlap(const ByteRuns& a, const ByteRuns& b) {
  if (a.rows == 0 || b.rows == 0 || a.end() <= b.begin || b.end() <= a.begin) return false;
  if (a.rows == 1) return touches(b, a.begin, a.begin + a.width);
  if (b.rows == 1) return touches(a, b.begin, b.begin + b.width);
  if (a.stride == b.stride) {
    // Run r of a meets run q of b iff d - a.width < (r - q) * stride < d + b.width, with d = b.begin - a.begin
    // and r - q anywhere in [1 - b.rows, a.rows - 1]: test the smallest k above the lower bound.
    const int64_t d = b.begin - a.begin;
    const int64_t k = std::max(floor_div(d - a.width, a.stride) + 1, 1 - b.rows);
    return k <= a.rows - 1 && k * a.stride < d + b.width;
  }
  // Different spacings: walk the runs of the wider-spaced tensor that lie inside the other's span.
  const ByteRuns& walked = a.stride > b.stride ? a : b;
  const ByteRuns& other = a.stride > b.stride ? b : a;
  for (int64_t r = first_run_ending_after(walked, other.begin);
       r < walked.rows && walked.begin + r * walked.stride < other.end(); ++r) {
    const int64_t lo = walked.begin + r * walked.stride;
    if (touches(other, lo, lo + walked.width)) return true;
  }
  return false;
}

}  // namespace

void check_written_disjoint(const char* op, std::initializer_list<TensorArg> written,
                            std::initializer_list<TensorArg> read) {
  // Written arguments first, then the read ones; each described once.
  constexpr size_t kMaxArgs = 16;
  DSV4_CHECK(written.size() + read.size() <= kMaxArgs, op, "internal error: too many arguments to check for overlap");
  std::array<const TensorArg*, kMaxArgs> args;
  std::array<std::optional<ByteRuns>, kMaxArgs> runs;
  size_t count = 0;
  for (const TensorArg& a : written) args[count++] = &a;
  for (const TensorArg& a : read) args[count++] = &a;
  for (size_t i = 0; i < count; ++i) runs[i] = byte_runs(args[i]->tensor);
  for (size_t w = 0; w < written.size(); ++w) {
    for (size_t other = w + 1; other < count; ++other) {
      if (!runs[w] || !runs[other]) continue;  // not equally spaced runs: not checked
      DSV4_CHECK(!overlap(*runs[w], *runs[other]), op, args[w]->name, " shares memory with ", args[other]->name,
                 " (the op writes ", args[w]->name, ", so no other argument may alias it)");
    }
  }
}

}  // namespace dsv4
