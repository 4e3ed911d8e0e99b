// libaqua_ort.so: what ONNX Runtime and onnxruntime-genai register (SessionOptions.register_custom_ops_library,
// genai_config.json's custom_ops_library). It holds no kernel: it picks the variant library beside it that the CPU
// it runs on can execute, the best first, and hands the session options to that variant's AquaRegisterOps.
//
//   libaqua_ort_x86-64-v4.so   AVX-512 (F, BW, CD, DQ, VL)
//   libaqua_ort_x86-64-v3.so   AVX2, FMA, F16C, BMI1/2, MOVBE
//   libaqua_ort_x86-64-v2.so   SSE4.2, POPCNT, SSSE3 (the baseline)
//   libaqua_ort_armv8-a.so     an aarch64 build's one variant
// (the same sources, one -march each: CMakeLists.txt)
//
// This file is compiled for the architecture's baseline, so it runs anywhere; the CPU is read with GCC's
// __builtin_cpu_supports, which also asks the operating system whether it saves the vector registers (XGETBV).
// AQUA_ORT_ISA=<variant> forces one (an error when this CPU cannot run it or its file is missing): the tests run
// every path this CPU has. No variant for this CPU (an x86-64 older than x86-64-v2) or none beside this file: one
// line on stderr, no kernel registered, and ONNX Runtime runs the graph's ONNX function bodies instead.

#include <dlfcn.h>
#include <onnxruntime_c_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

struct Variant {
  const char* name;
  bool (*runs)();  // can this CPU (and operating system) execute it?
};

#if defined(__x86_64__)
bool has_v4() { return __builtin_cpu_supports("x86-64-v4"); }
bool has_v3() { return __builtin_cpu_supports("x86-64-v3"); }
bool has_v2() { return __builtin_cpu_supports("x86-64-v2"); }
constexpr Variant kVariants[] = {{"x86-64-v4", has_v4}, {"x86-64-v3", has_v3}, {"x86-64-v2", has_v2}};
constexpr const char* kBaselineNeeds = "SSE4.2 and POPCNT (x86-64-v2)";
#elif defined(__aarch64__)
bool always() { return true; }
constexpr Variant kVariants[] = {{"armv8-a", always}};
constexpr const char* kBaselineNeeds = "Armv8-A";
#else
#error "libaqua_ort has variants for x86-64 and aarch64 only"
#endif

constexpr const char* kEnv = "AQUA_ORT_ISA";
using Register = OrtStatus*(ORT_API_CALL*)(OrtSessionOptions*, const OrtApiBase*);

// The folder this library was loaded from (its variants lie beside it).
std::string own_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_folder), &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string variant_path(const char* name) { return own_folder() + "/libaqua_ort_" + name + ".so"; }

bool present(const char* name) {
  FILE* f = std::fopen(variant_path(name).c_str(), "rb");
  if (f == nullptr) return false;
  std::fclose(f);
  return true;
}

const Variant* find(const char* name) {
  for (const auto& v : kVariants) {
    if (std::strcmp(v.name, name) == 0) return &v;
  }
  return nullptr;
}

std::string names() {
  std::string out;
  for (const auto& v : kVariants) out += std::string(out.empty() ? "" : ", ") + v.name;
  return out;
}

// The variant to register: (name, "") or, when AQUA_ORT_ISA names one that cannot run, ("", why). Unforced and no
// variant runnable here: ("", "").
std::pair<std::string, std::string> choose() {
  __builtin_cpu_init();
  const char* forced = std::getenv(kEnv);
  if (forced != nullptr && *forced != '\0' && std::strcmp(forced, "auto") != 0) {
    const Variant* v = find(forced);
    if (v == nullptr) return {"", std::string(kEnv) + "=" + forced + " is not a variant: use one of " + names()};
    if (!v->runs()) return {"", std::string(kEnv) + "=" + forced + ": this CPU cannot run that variant: unset it"};
    if (!present(forced)) return {"", std::string(kEnv) + "=" + forced + ": " + variant_path(forced) + " is missing"};
    return {forced, ""};
  }
  for (const auto& v : kVariants) {
    if (v.runs() && present(v.name)) return {v.name, ""};
  }
  return {"", ""};
}

OrtStatus* fail(const OrtApiBase* api_base, const std::string& text) {
  return api_base->GetApi(ORT_API_VERSION)->CreateStatus(ORT_INVALID_ARGUMENT, ("libaqua_ort: " + text).c_str());
}

// The variant RegisterCustomOps registers here, loaded (kept for the process's life), or null when none runs.
void* chosen_variant() {
  const auto [name, error] = choose();
  if (name.empty() || !error.empty()) return nullptr;
  return dlopen(variant_path(name.c_str()).c_str(), RTLD_NOW | RTLD_LOCAL);
}

std::mutex g_mutex;
std::string g_chosen;  // AquaOrtVariant's answer, kept alive for the caller

}  // namespace

#define AQUA_EXPORT __attribute__((visibility("default")))

extern "C" {

// Entry point looked up by SessionOptions.register_custom_ops_library (and onnxruntime-genai).
AQUA_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const auto [name, error] = choose();
  if (!error.empty()) return fail(api_base, error);
  if (name.empty()) {
    static std::once_flag said;
    std::call_once(said, [] {
      std::fprintf(stderr, "libaqua_ort: no kernel variant for this CPU (the kernels need at least %s, and one of "
                   "%s beside %s/libaqua_ort.so): the com.aqua nodes run their ONNX function bodies (slower)\n",
                   kBaselineNeeds, names().c_str(), own_folder().c_str());
    });
    return nullptr;  // nothing registered: ONNX Runtime inlines the nodes' function bodies
  }
  void* lib = dlopen(variant_path(name.c_str()).c_str(), RTLD_NOW | RTLD_LOCAL);  // kept for the process's life
  if (lib == nullptr) return fail(api_base, std::string("cannot load the ") + name + " variant: " + dlerror());
  auto reg = reinterpret_cast<Register>(dlsym(lib, "AquaRegisterOps"));
  if (reg == nullptr) return fail(api_base, variant_path(name.c_str()) + " has no AquaRegisterOps: rebuild it");
  return reg(options, api_base);
}

// The variant RegisterCustomOps registers here now ("" when none: the function bodies run; "!why" when
// AQUA_ORT_ISA names one it cannot): what `aqua-export run` reports and the tests check.
AQUA_EXPORT const char* AquaOrtVariant() {
  const auto [name, error] = choose();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_chosen = error.empty() ? name : "!" + error;
  return g_chosen.c_str();
}

// Whether that variant runs a prompt_bf16 node's products in bfloat16 (its AquaPromptBf16: the width has the
// instructions and this CPU reports them); 0 when none runs.
AQUA_EXPORT int AquaOrtPromptBf16() {
  void* lib = chosen_variant();
  auto ask = lib != nullptr ? reinterpret_cast<int (*)()>(dlsym(lib, "AquaPromptBf16")) : nullptr;
  return ask != nullptr ? ask() : 0;
}

// That variant's one-thread multiply-add rate in GFLOP/s, measured for about `seconds` (its AquaPeakGflops); 0 when
// none runs.
AQUA_EXPORT double AquaOrtPeakGflops(double seconds) {
  void* lib = chosen_variant();
  auto ask = lib != nullptr ? reinterpret_cast<double (*)(double)>(dlsym(lib, "AquaPeakGflops")) : nullptr;
  return ask != nullptr ? ask(seconds) : 0.0;
}

// The C API version the kernels were compiled against (checked by tests/test_ops.py).
AQUA_EXPORT uint32_t AquaOrtApiVersion() { return ORT_API_VERSION; }

}  // extern "C"
