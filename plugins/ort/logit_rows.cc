// LogitRows (aqua_export/ops/logit_rows.py): rows [B, K, V], index [B, K] int64, length [1] int64 (T)
//   -> logits [B, T, V] with logits[b, index[b, k]] = rows[b, k]; the other rows are not written, so the pages of a
//   prompt's unread logits are never touched (and never resident).

#include "aqua_ops.h"

namespace {

using namespace aqua;

template <typename T>
struct RowsKernel {
  explicit RowsKernel(const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto rows = ctx.GetInput(0), index = ctx.GetInput(1);
    const auto rs = rows.GetTensorTypeAndShapeInfo().GetShape();
    const auto is = index.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t t = total_length(ctx, 2);
    if (rs.size() != 3 || is.size() != 2 || is[0] != rs[0] || is[1] != rs[1] || t < 0) {
      ORT_CXX_API_THROW("LogitRows: expected rows [B,K,V], index [B,K] and length [1] >= 0", ORT_INVALID_ARGUMENT);
    }
    auto out = ctx.GetOutput(0, std::vector<int64_t>{rs[0], t, rs[2]});
    const T* src = rows.GetTensorData<T>();
    const int64_t* at = index.GetTensorData<int64_t>();
    T* dst = out.GetTensorMutableData<T>();
    for (int64_t b = 0; b < rs[0]; ++b) {
      for (int64_t k = 0; k < rs[1]; ++k) {
        const int64_t p = at[b * rs[1] + k];
        if (p < 0 || p >= t) ORT_CXX_API_THROW("LogitRows: an index is not a position of 0..T-1", ORT_INVALID_ARGUMENT);
        std::memcpy(dst + (b * t + p) * rs[2], src + (b * rs[1] + k) * rs[2], sizeof(T) * rs[2]);
      }
    }
  }
};

template <typename T>
struct RowsOp : CpuOp<RowsOp<T>, RowsKernel<T>, T, 3, 2, 99, 3, T, 0u, 0b10u> {
  const char* GetName() const { return "LogitRows"; }
};

}  // namespace

namespace aqua {

void add_logit_rows_ops(Ort::CustomOpDomain& domain) {
  static RowsOp<float> f32;
  static RowsOp<Ort::Float16_t> f16;
  domain.Add(&f32);
  domain.Add(&f16);
}

}  // namespace aqua
