// FlashMLA's SM90 dense decode kernel (deepseek-ai/FlashMLA) behind a binding that allocates nothing.
//
// Owns: the host side of one MLA attention call over the paged latent cache, for one KV head (Kimi-K3's
// absorbed form): the split schedule (FlashMLA's get_decoding_sched_meta kernel, from the device's
// sequence lengths, so a CUDA graph replays it for new lengths), the split-KV kernel and its combine,
// all into buffers the caller owns (graph-stable addresses: the kernel's TMA descriptors hold them).
// Built at run time by ``flash_mla.py`` against a FlashMLA source tree and CUTLASS's headers.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kBlockM = 64;     // q rows (s_q x heads) per program
constexpr int kPage = 64;       // the kernel's KV page
constexpr int kHeadDimK = 576;  // latent 512 + rope 64
constexpr int kHeadDimV = 512;

int sm_parts(int s_q, int h_q) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int m_blocks = (s_q * h_q + kBlockM - 1) / kBlockM;
  return std::max(sms / m_blocks, 1);
}

void check(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

}  // namespace

int64_t num_sm_parts(int64_t s_q, int64_t h_q) { return sm_parts(static_cast<int>(s_q), static_cast<int>(h_q)); }

int64_t sched_meta_ints() { return sizeof(DecodingSchedMeta) / sizeof(int); }

// The split schedule of a batch: sched [num_sm_parts, sched_meta_ints()] int32, num_splits [b + 1] int32.
void plan(const at::Tensor& seqlens, int64_t s_q, const at::Tensor& sched, const at::Tensor& num_splits) {
  check(seqlens, at::kInt, "seqlens");
  check(sched, at::kInt, "sched");
  check(num_splits, at::kInt, "num_splits");
  TORCH_CHECK(seqlens.is_contiguous() && sched.is_contiguous() && num_splits.is_contiguous());
  const int b = static_cast<int>(seqlens.size(0));
  TORCH_CHECK(num_splits.size(0) == b + 1, "num_splits must hold b + 1 ints");
  TORCH_CHECK(sched.dim() == 2 && sched.size(1) == sched_meta_ints(), "sched must be [parts, ", sched_meta_ints(), "]");
  at::cuda::CUDAGuard guard(seqlens.device());
  GetDecodeSchedMetaParams p = {
      b, static_cast<int>(s_q), kPage, 5, -1, -1, nullptr, nullptr,
      seqlens.data_ptr<int>(), reinterpret_cast<DecodingSchedMeta*>(sched.data_ptr()), num_splits.data_ptr<int>(),
      static_cast<int>(sched.size(0)), at::cuda::getCurrentCUDAStream().stream()};
  smxx::decode::run_get_decoding_sched_meta_kernel(p);
}

// out [b, s_q, h_q, 512] (q's dtype) = attention of q [b, s_q, h_q, 576] over kcache [pages, 64, 1, 576]:
// session i reads its first seqlens[i] tokens through block_table[i] (causal: row j of s_q sees all but
// the last s_q - 1 - j). lse [b, s_q * h_q] float32; lse_accum [b + parts, s_q * h_q] and
// o_accum [b + parts, s_q * h_q, 512] float32 are the splits' scratch.
void attend(const at::Tensor& q, const at::Tensor& kcache, const at::Tensor& seqlens, const at::Tensor& block_table,
            double scale, bool causal, const at::Tensor& sched, const at::Tensor& num_splits, const at::Tensor& out,
            const at::Tensor& lse, const at::Tensor& lse_accum, const at::Tensor& o_accum) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16, "FlashMLA decode: bf16 only here, got ", dtype);
  check(kcache, dtype, "kcache");
  check(out, dtype, "out");
  check(seqlens, at::kInt, "seqlens");
  check(block_table, at::kInt, "block_table");
  check(lse, at::kFloat, "lse");
  check(lse_accum, at::kFloat, "lse_accum");
  check(o_accum, at::kFloat, "o_accum");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && q.size(3) == kHeadDimK, "q must be contiguous [b, s_q, h_q, 576]");
  const int b = static_cast<int>(q.size(0)), s_q = static_cast<int>(q.size(1)), h_q = static_cast<int>(q.size(2));
  const int rows = s_q * h_q;
  TORCH_CHECK(kcache.dim() == 4 && kcache.size(1) == kPage && kcache.size(2) == 1 && kcache.size(3) == kHeadDimK &&
                  kcache.stride(3) == 1 && kcache.stride(2) == kHeadDimK && kcache.stride(1) == kHeadDimK,
              "kcache must be [pages, 64, 1, 576] with packed pages");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == b && out.size(1) == s_q && out.size(2) == h_q &&
                  out.size(3) == kHeadDimV, "out must be contiguous [b, s_q, h_q, 512]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == b && block_table.stride(1) == 1, "block_table [b, pages]");
  TORCH_CHECK(seqlens.size(0) == b && seqlens.is_contiguous(), "seqlens [b]");
  const int parts = static_cast<int>(sched.size(0));
  TORCH_CHECK(parts == sm_parts(s_q, h_q), "sched was sized for another shape");
  TORCH_CHECK(num_splits.size(0) == b + 1, "num_splits [b + 1]");
  TORCH_CHECK(lse.is_contiguous() && lse.numel() == static_cast<int64_t>(b) * rows, "lse [b, s_q * h_q]");
  TORCH_CHECK(lse_accum.is_contiguous() && lse_accum.numel() == static_cast<int64_t>(b + parts) * rows,
              "lse_accum [b + parts, s_q * h_q]");
  TORCH_CHECK(o_accum.is_contiguous() && o_accum.numel() == static_cast<int64_t>(b + parts) * rows * kHeadDimV,
              "o_accum [b + parts, s_q * h_q, 512]");
  at::cuda::CUDAGuard guard(q.device());
  const auto stream = at::cuda::getCurrentCUDAStream().stream();

  DenseAttnDecodeParams p;
  p.b = b;
  p.s_q = s_q;
  p.q_seq_per_hk = rows;  // one KV head: q rows are (s, h) pairs in memory order
  p.seqlens_k_ptr = seqlens.data_ptr<int>();
  p.h_q = h_q;
  p.h_k = 1;
  p.num_blocks = static_cast<int>(kcache.size(0));
  p.q_head_per_hk = h_q;
  p.is_causal = causal && s_q > 1;
  p.d = kHeadDimK;
  p.d_v = kHeadDimV;
  p.scale_softmax = static_cast<float>(scale);
  p.scale_softmax_log2 = static_cast<float>(scale * M_LOG2E);
  p.q_ptr = q.data_ptr();
  p.k_ptr = kcache.data_ptr();
  p.o_ptr = out.data_ptr();
  p.softmax_lse_ptr = lse.data_ptr<float>();
  p.q_batch_stride = static_cast<int64_t>(rows) * kHeadDimK;
  p.q_row_stride = kHeadDimK;
  p.q_head_stride = static_cast<int64_t>(rows) * kHeadDimK;
  p.k_batch_stride = kcache.stride(0);
  p.k_row_stride = kcache.stride(1);
  p.k_head_stride = kcache.stride(2);
  p.o_batch_stride = static_cast<int64_t>(rows) * kHeadDimV;
  p.o_row_stride = kHeadDimV;
  p.o_head_stride = static_cast<int64_t>(rows) * kHeadDimV;
  p.block_table = block_table.data_ptr<int>();
  p.block_table_batch_stride = block_table.stride(0);
  p.page_block_size = kPage;
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(sched.data_ptr());
  p.num_sm_parts = parts;
  p.num_splits_ptr = num_splits.data_ptr<int>();
  p.total_num_splits = b + parts;
  p.softmax_lseaccum_ptr = lse_accum.data_ptr<float>();
  p.oaccum_ptr = o_accum.data_ptr<float>();
  p.stream = stream;
  sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

  CombineParams c = {
      b, s_q, h_q, kHeadDimV,
      p.softmax_lse_ptr, p.o_ptr, rows, h_q, rows * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
      p.softmax_lseaccum_ptr, p.oaccum_ptr, rows, h_q, rows * kHeadDimV, h_q * kHeadDimV, kHeadDimV,
      p.tile_scheduler_metadata_ptr, p.num_splits_ptr, parts, nullptr, stream};
  smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("num_sm_parts", &num_sm_parts);
  m.def("sched_meta_ints", &sched_meta_ints);
  m.def("plan", &plan);
  m.def("attend", &attend);
}
