// forge's cache-hit fast path (forge/fastcall.py builds this file with torch.utils.cpp_extension).
//
// A FastCall is made for one call signature of one bound kernel, from the launches forge/launch.py
// recorded and proved. One C++ call then does what the Python hot path does in ~10 bytecode-heavy
// steps: check the positional arguments against that signature (shape, strides, dtype, device,
// requires_grad, 16-byte alignment, grad mode, autocast off, non-tensor values by ==), check that no Triton launch
// hook is installed and the current device is the bound one, allocate the output with
// at::empty_strided, and launch each recorded kernel with cuLaunchKernel. Any mismatch returns None and
// the caller takes the Python path, which decides everything again; nothing here ever guesses.
//
// Why C++: on the H200 host a Python cache hit cost ~11-17 us, of which the key was 2.4-4.1, the
// output allocation through torch's Python binding 2.2-4.4 and Triton's C launch function 4.6-6.3
// (docs/notes.md, "Cache-hit latency"); a single eager aten op costs 7-10 us there.
#include <torch/python.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/core/grad_mode.h>
#include <ATen/autocast_mode.h>

#include <dlfcn.h>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// The CUDA driver entry points, looked up in libcuda at first use (no CUDA headers or link needed, so
// this file also builds on machines without CUDA, where the tests run it with fn == 0: no launch).
typedef int (*cuLaunchKernel_t)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                void*, void**, void**);
typedef int (*cuCtxGetCurrent_t)(void**);

struct Driver {
  cuLaunchKernel_t launch = nullptr;
  cuCtxGetCurrent_t ctx = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver r;
    void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (h) {
      r.launch = reinterpret_cast<cuLaunchKernel_t>(dlsym(h, "cuLaunchKernel"));
      r.ctx = reinterpret_cast<cuCtxGetCurrent_t>(dlsym(h, "cuCtxGetCurrent"));
    }
    return r;
  }();
  return d;
}

// Kernel parameter kinds (widths as Triton's launchers pass them: fp32 scalars as 4-byte floats).
enum Kind : int { PTR = 0, NULLPTR, I8, I16, I32, I64, U8, U16, U32, U64, F32, F64 };
constexpr int kMaxParams = 64;

struct Param {
  int kind;
  int slot;    // PTR: index into (inputs..., out)
  int64_t i;   // integer value
  double d;    // float value
};

struct Launch {
  uint64_t fn;  // CUfunction; 0 = do not launch (tests on machines without CUDA)
  unsigned gx, gy, gz, block, shared;
  std::vector<Param> params;
};

struct TSpec {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  bool requires_grad = false;
  bool aligned = true;     // data_ptr % 16 == 0
  bool is_cuda = false;
  int index = -1;          // get_device(): -1 on the CPU
};

std::vector<int64_t> ints(const py::handle& seq) {
  std::vector<int64_t> v;
  for (auto x : seq) v.push_back(x.cast<int64_t>());
  return v;
}

// (sizes, strides, dtype) or (sizes, strides, dtype, requires_grad, aligned, is_cuda, index)
TSpec tspec(const py::handle& t) {
  auto tup = t.cast<py::tuple>();
  if (tup.size() != 3 && tup.size() != 7) throw std::invalid_argument("a tensor spec has 3 or 7 fields");
  TSpec s;
  s.sizes = ints(tup[0]);
  s.strides = ints(tup[1]);
  s.dtype = torch::python::detail::py_object_to_dtype(py::reinterpret_borrow<py::object>(tup[2]));
  if (tup.size() == 7) {
    s.requires_grad = tup[3].cast<bool>();
    s.aligned = tup[4].cast<bool>();
    s.is_cuda = tup[5].cast<bool>();
    s.index = tup[6].cast<int>();
  }
  return s;
}

bool same(c10::IntArrayRef a, const std::vector<int64_t>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < b.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

bool any_autocast() {
  return at::autocast::is_autocast_enabled(at::kCUDA) || at::autocast::is_autocast_enabled(at::kCPU);
}

// One call signature: grad mode, autocast, and per positional argument a tensor layout or a value. What
// the shim's Python key holds (forge/shim.py _signature), checked on at::Tensor metadata.
class Guard {
 public:
  Guard(bool grad, bool autocast, const py::list& args) : grad_(grad), autocast_(autocast) {
    for (auto a : args) {
      auto t = a.cast<py::tuple>();
      std::string what = t[0].cast<std::string>();
      if (what == "tensor") {
        is_tensor_.push_back(true);
        specs_.push_back(tspec(t[1]));
        values_.push_back(py::none());
      } else if (what == "value") {
        is_tensor_.push_back(false);
        specs_.push_back(TSpec{});
        values_.push_back(py::reinterpret_borrow<py::object>(t[1]));
      } else {
        throw std::invalid_argument("argument kind must be 'tensor' or 'value'");
      }
    }
    if (is_tensor_.size() > kMaxParams) throw std::invalid_argument("more than 64 arguments");
  }

  // True if `args` is this signature; its tensors are then in ts[0..n).
  bool match(const py::args& args, at::Tensor* ts) const {
    const size_t n = is_tensor_.size();
    if (args.size() != n || at::GradMode::is_enabled() != grad_ || any_autocast() != autocast_) return false;
    for (size_t k = 0; k < n; ++k) {
      PyObject* o = args[k].ptr();
      if (is_tensor_[k]) {
        if (!THPVariable_Check(o)) return false;
        const at::Tensor& t = THPVariable_Unpack(o);
        const TSpec& s = specs_[k];
        if (t.scalar_type() != s.dtype || t.requires_grad() != s.requires_grad || !same(t.sizes(), s.sizes) ||
            !same(t.strides(), s.strides) || t.is_cuda() != s.is_cuda || t.get_device() != s.index)
          return false;
        if (t.is_meta() || ((reinterpret_cast<uintptr_t>(t.data_ptr()) % 16) == 0) != s.aligned) return false;
        ts[k] = t;
      } else {
        // Same type, then ==: stricter than the Python key (where 1 == 1.0 == True); a miss only costs
        // the Python path, and a 0-d tensor equal to a bound scalar is never taken for it.
        if (Py_TYPE(o) != Py_TYPE(values_[k].ptr())) return false;
        int eq = PyObject_RichCompareBool(o, values_[k].ptr(), Py_EQ);
        if (eq < 0) {
          PyErr_Clear();
          return false;
        }
        if (!eq) return false;
      }
    }
    return true;
  }

  bool is_tensor(size_t k) const { return k < is_tensor_.size() && is_tensor_[k]; }
  size_t size() const { return is_tensor_.size(); }

 private:
  bool grad_, autocast_;
  std::vector<bool> is_tensor_;
  std::vector<TSpec> specs_;
  std::vector<py::object> values_;
};

}  // namespace

// A bound kernel's signature: the output tensor of its recorded launches, or None (a miss).
class FastCall {
 public:
  // args: per positional argument, ("tensor", (sizes, strides, dtype[, requires_grad])) or ("value", obj);
  //   a kernel's tensors are 16-byte aligned and on `device` (what the shim binds kernels for) and require
  //   grad only where that is given (parameters read under no_grad: `grad` is false then)
  // sources: per kernel input, an int (index of a positional argument) or a tensor held here
  // out: (sizes, strides, dtype); launches: [(fn, gx, gy, gz, block, shared, [(kind, slot, i, d), ...])]
  // device: the CUDA device index, or -1 for CPU tensors (tests only: nothing is launched)
  // runtime / chain: triton.knobs.runtime and triton.knobs.HookChain; stream: f(device) -> raw stream
  FastCall(bool grad, int device, py::list args, py::list sources, py::tuple out, py::list launches,
           py::object runtime, py::object chain, py::object stream, py::object current_device)
      : guard_(grad, false, kernel_specs(args, device)), device_(device), runtime_(runtime), chain_(chain),
        stream_(stream), current_device_(current_device) {
    for (auto s : sources) {
      if (py::isinstance<py::int_>(s)) {
        int k = s.cast<int>();
        if (k < 0 || !guard_.is_tensor(static_cast<size_t>(k)))
          throw std::invalid_argument("a source index must name a tensor argument");
        source_arg_.push_back(k);
        held_.push_back(at::Tensor());
      } else if (THPVariable_Check(s.ptr())) {
        source_arg_.push_back(-1);
        held_.push_back(THPVariable_Unpack(s.ptr()));
      } else {
        throw std::invalid_argument("a source is an argument index or a tensor");
      }
    }
    if (source_arg_.size() > kMaxParams) throw std::invalid_argument("too many kernel inputs");
    out_ = tspec(out);
    for (auto l : launches) {
      auto t = l.cast<py::tuple>();
      Launch ln{t[0].cast<uint64_t>(), t[1].cast<unsigned>(), t[2].cast<unsigned>(), t[3].cast<unsigned>(),
                t[4].cast<unsigned>(), t[5].cast<unsigned>(), {}};
      for (auto p : t[6]) {
        auto q = p.cast<py::tuple>();
        Param pa{q[0].cast<int>(), q[1].cast<int>(), q[2].cast<int64_t>(), q[3].cast<double>()};
        if (pa.kind < PTR || pa.kind > F64) throw std::invalid_argument("unknown parameter kind");
        if (pa.kind == PTR && (pa.slot < 0 || pa.slot > static_cast<int>(source_arg_.size())))
          throw std::invalid_argument("pointer slot out of range");
        ln.params.push_back(pa);
      }
      if (ln.params.size() > kMaxParams) throw std::invalid_argument("too many kernel parameters");
      if (ln.fn != 0 && device_ < 0) throw std::invalid_argument("a launch needs a CUDA device");
      launches_.push_back(std::move(ln));
    }
    if (device_ >= 0 && !launches_.empty() && !driver().launch)
      throw std::runtime_error("libcuda.so.1 has no cuLaunchKernel");
  }

  // The output tensor, or None when this call is not the bound signature (or a hook/device changed).
  py::object call(py::args args) {
    at::Tensor ts[kMaxParams];
    if (!guard_.match(args, ts)) return py::none();
    uint64_t stream = 0;
    if (device_ >= 0) {
      if (!hooks_quiet() || current_device_().cast<int>() != device_) return py::none();
      void* ctx = nullptr;
      if (driver().ctx == nullptr || driver().ctx(&ctx) != 0 || ctx == nullptr) return py::none();
      stream = stream_(device_).cast<uint64_t>();
    }
    auto opts = at::TensorOptions().dtype(out_.dtype).device(
        device_ >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_)) : at::Device(at::kCPU));
    at::Tensor out = at::empty_strided(out_.sizes, out_.strides, opts);
    uint64_t ptrs[kMaxParams + 1];
    const size_t ns = source_arg_.size();
    for (size_t j = 0; j < ns; ++j) {
      const at::Tensor& t = source_arg_[j] >= 0 ? ts[source_arg_[j]] : held_[j];
      ptrs[j] = reinterpret_cast<uint64_t>(t.data_ptr());
    }
    ptrs[ns] = reinterpret_cast<uint64_t>(out.data_ptr());
    for (const Launch& ln : launches_) {
      uint64_t store[kMaxParams];
      void* params[kMaxParams];
      pack(ln, ptrs, store, params);
      if (ln.fn == 0) continue;
      int rc = driver().launch(reinterpret_cast<void*>(ln.fn), ln.gx, ln.gy, ln.gz, ln.block, 1, 1, ln.shared,
                               reinterpret_cast<void*>(stream), params, nullptr);
      if (rc != 0) throw std::runtime_error("forge fast path: cuLaunchKernel failed with CUresult " +
                                            std::to_string(rc));
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(out));
  }

  // The parameter bytes launch `i` would get for these pointers (tests: the packing, checked byte for byte).
  py::bytes packed(size_t i, std::vector<uint64_t> pointers) const {
    const Launch& ln = launches_.at(i);
    if (pointers.size() != source_arg_.size() + 1) throw std::invalid_argument("one pointer per slot");
    uint64_t store[kMaxParams];
    void* params[kMaxParams];
    pack(ln, pointers.data(), store, params);
    std::string bytes;
    for (size_t k = 0; k < ln.params.size(); ++k)
      bytes.append(reinterpret_cast<const char*>(params[k]), width(ln.params[k].kind));
    return py::bytes(bytes);
  }

 private:
  static size_t width(int kind) {
    switch (kind) {
      case I8: case U8: return 1;
      case I16: case U16: return 2;
      case I32: case U32: case F32: return 4;
      default: return 8;
    }
  }

  static void pack(const Launch& ln, const uint64_t* ptrs, uint64_t* store, void** params) {
    for (size_t k = 0; k < ln.params.size(); ++k) {
      const Param& p = ln.params[k];
      store[k] = 0;
      void* dst = &store[k];
      switch (p.kind) {
        case PTR: store[k] = ptrs[p.slot]; break;
        case NULLPTR: break;
        case I8: { int8_t v = static_cast<int8_t>(p.i); std::memcpy(dst, &v, 1); break; }
        case U8: { uint8_t v = static_cast<uint8_t>(p.i); std::memcpy(dst, &v, 1); break; }
        case I16: { int16_t v = static_cast<int16_t>(p.i); std::memcpy(dst, &v, 2); break; }
        case U16: { uint16_t v = static_cast<uint16_t>(p.i); std::memcpy(dst, &v, 2); break; }
        case I32: { int32_t v = static_cast<int32_t>(p.i); std::memcpy(dst, &v, 4); break; }
        case U32: { uint32_t v = static_cast<uint32_t>(p.i); std::memcpy(dst, &v, 4); break; }
        case I64: { int64_t v = p.i; std::memcpy(dst, &v, 8); break; }
        case U64: { uint64_t v = static_cast<uint64_t>(p.i); std::memcpy(dst, &v, 8); break; }
        case F32: { float v = static_cast<float>(p.d); std::memcpy(dst, &v, 4); break; }
        case F64: { double v = p.d; std::memcpy(dst, &v, 8); break; }
      }
      params[k] = dst;
    }
  }

  // As forge/launch.py's Plan.usable: no Triton launch hook (None or an empty HookChain).
  bool hooks_quiet() const {
    for (const char* name : {"launch_enter_hook", "launch_exit_hook"}) {
      py::object h = runtime_.attr(name);
      if (h.is_none()) continue;
      if (!chain_.is_none() && Py_TYPE(h.ptr()) == reinterpret_cast<PyTypeObject*>(chain_.ptr()) &&
          py::len(h.attr("calls")) == 0)
        continue;
      return false;
    }
    return true;
  }

  static py::list kernel_specs(const py::list& args, int device) {
    py::list out;
    for (auto a : args) {
      auto t = a.cast<py::tuple>();
      if (t[0].cast<std::string>() == "tensor") {
        auto f = t[1].cast<py::tuple>();
        if (f.size() != 3 && f.size() != 4)
          throw std::invalid_argument("a kernel's tensor spec is (sizes, strides, dtype[, requires_grad])");
        // requires_grad: a module's parameters do (the backend's regions read them, under no_grad: the
        // guard's grad mode is off then); the kernel only reads their values
        py::object rg = f.size() == 4 ? py::object(f[3]) : py::object(py::bool_(false));
        out.append(py::make_tuple("tensor", py::make_tuple(f[0], f[1], f[2], rg, true, device >= 0,
                                                            device >= 0 ? device : -1)));
      } else {
        out.append(t);
      }
    }
    return out;
  }

  Guard guard_;
  int device_;
  std::vector<int> source_arg_;
  std::vector<at::Tensor> held_;
  TSpec out_;
  std::vector<Launch> launches_;
  py::object runtime_, chain_, stream_, current_device_;
};

// A signature the shim decided to run eagerly: (the user's function's result,), or None (a miss).
// Saves the Python key and lookup on each such call; the function itself runs as before.
class EagerCall {
 public:
  // args: per positional argument, ("tensor", (sizes, strides, dtype, requires_grad, aligned, is_cuda,
  // index)) or ("value", obj)
  EagerCall(bool grad, bool autocast, py::list args, py::object fn) : guard_(grad, autocast, args), fn_(fn) {}

  py::object call(py::args args) {
    at::Tensor ts[kMaxParams];
    if (!guard_.match(args, ts)) return py::none();
    return py::make_tuple(fn_(*args));
  }

 private:
  Guard guard_;
  py::object fn_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<EagerCall>(m, "EagerCall")
      .def(py::init<bool, bool, py::list, py::object>())
      .def("__call__", &EagerCall::call);
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<bool, int, py::list, py::list, py::tuple, py::list, py::object, py::object, py::object,
                    py::object>())
      .def("__call__", &FastCall::call)
      .def("packed", &FastCall::packed);
}
