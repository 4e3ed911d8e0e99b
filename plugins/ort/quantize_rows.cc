// QuantizeRows (aqua_export/ops/quantize_rows.py): x [..., w] float32 -> rows [..., w + 1] int8, an int8 cache's
//   rows: round(x / s) (half to even) clipped to +-127, then the code c of s, the smallest table scale (ops.spec,
//   int8_scale) >= max |x| / 127, the top code when none is. The same float32 operations as the function body
//   (Abs, ReduceMax, Div by 127, the count of table scales below, Div by s, Round, Clip), so the same bytes.

#include <algorithm>
#include <array>
#include <cmath>

#include "aqua_ops.h"

namespace {

using namespace aqua;

constexpr int kCodeLo = -128, kCodes = 256;  // ops.spec SCALE_CODES
constexpr int64_t kRowsPerTask = 256;

const std::array<float, kCodes>& scale_table() {
  static const std::array<float, kCodes> table = [] {
    std::array<float, kCodes> t{};
    for (int i = 0; i < kCodes; ++i) t[i] = int8_scale(static_cast<int8_t>(i + kCodeLo));
    return t;
  }();
  return table;
}

struct RowsJob {
  const float* x;
  int8_t* out;
  int64_t rows, w;
};

void quantize_task(void* data, size_t task) {
  const auto& j = *static_cast<const RowsJob*>(data);
  const auto& table = scale_table();
  const int64_t r0 = static_cast<int64_t>(task) * kRowsPerTask, r1 = std::min(j.rows, r0 + kRowsPerTask);
  for (int64_t row = r0; row < r1; ++row) {
    const float* x = j.x + row * j.w;
    int8_t* o = j.out + row * (j.w + 1);
    float amax = 0.0f;
    for (int64_t i = 0; i < j.w; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float least = amax / 127.0f;
    // the count of scales below least (the table ascends), capped at the top code
    const int64_t at = std::min<int64_t>(std::lower_bound(table.begin(), table.end(), least) - table.begin(), kCodes - 1);
    const float s = table[at];
    for (int64_t i = 0; i < j.w; ++i) {
      o[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / s), -127.0f, 127.0f));
    }
    o[j.w] = static_cast<int8_t>(at + kCodeLo);
  }
}

struct RowsKernel {
  explicit RowsKernel(const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0);
    auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() < 1) {
      ORT_CXX_API_THROW("QuantizeRows: expected x [..., w] with w >= 1", ORT_INVALID_ARGUMENT);
    }
    const int64_t w = shape.back();
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = w + 1;
    auto out = ctx.GetOutput(0, shape);
    if (rows == 0) return;
    RowsJob job{x.GetTensorData<float>(), out.GetTensorMutableData<int8_t>(), rows, w};
    ctx.ParallelFor(&quantize_task, static_cast<size_t>((rows + kRowsPerTask - 1) / kRowsPerTask), 0, &job);
  }
};

struct RowsOp : Ort::CustomOpBase<RowsOp, RowsKernel> {
  void* CreateKernel(const OrtApi&, const OrtKernelInfo* info) const { return new RowsKernel(info); }
  const char* GetName() const { return "QuantizeRows"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8; }
};

}  // namespace

namespace aqua {

void add_quantize_rows_ops(Ort::CustomOpDomain& domain) {
  static RowsOp op;
  domain.Add(&op);
}

}  // namespace aqua
