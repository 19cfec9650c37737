// `megaton`: the command-line entry point. User errors exit 2, internal errors exit 1.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "cli/commands.h"
#include "core/error.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "dist/runtime.h"

// OpenBLAS picks its GEMM kernels by CPU model when the library loads, and falls back to
// its slowest (SSE3 "Prescott") kernels on CPU models it does not know, such as the
// generic "Intel Xeon Processor" of many VMs: measured 2.8x slower training here. It
// reads OPENBLAS_CORETYPE only at load time, so when it is unset we choose by the
// instruction sets the CPU reports and restart this process once with it set.
static void choose_openblas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const char* core = nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    core = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    core = "Haswell";
  if (!core) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  execv("/proc/self/exe", argv);  // only returns on failure: keep going with the default
}

// --tp-comm-overlap on the command line: one hardware queue per device
// (CUDA_DEVICE_MAX_CONNECTIONS=1, unless set), read when the CUDA context is made, so
// here, before dist::init. Megatron requires it for the overlap on Hopper (arguments.py);
// measured on two H200s (docs/performance.md): TP2 llama-1.3B step 280.2 -> 266.4 ms with
// the overlap. (From a --config file the flag comes too late: set the variable there.)
static void choose_device_connections(int argc, char** argv) {
  if (std::getenv("CUDA_DEVICE_MAX_CONNECTIONS")) return;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--tp-comm-overlap") == 0) {
      setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 0);
      return;
    }
}

// Parses the command line and runs the chosen subcommand; returns the exit status.
static int run(CLI::App& app, int argc, char** argv) {
  // Under mpirun a message says which rank it comes from; alone, it stays one bare line.
  const std::string who =
      megaton::dist::world_size() > 1 ? fmt::format("[rank {}] ", megaton::dist::world_rank()) : "";
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "%serror: %s (see --help)\n", who.c_str(), e.what());
    return 2;
  } catch (const megaton::Error& e) {
    std::fprintf(stderr, "%serror: %s\n", who.c_str(), e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    // An allocation outside the tensor allocator (a container, a library): the run needs
    // more host memory than it can have, which the user fixes with smaller sizes.
    const megaton::HostMemoryAvailable avail = megaton::host_memory_available();
    std::fprintf(stderr, "%serror: out of host memory (std::bad_alloc): %s available (%s)\n",
                 who.c_str(), megaton::human_bytes(double(avail.available())).c_str(),
                 avail.binding_limit().c_str());
    return 2;
  } catch (const megaton::dist::CommError& e) {
    std::fprintf(stderr, "%scommunication error: %s\n", who.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%sinternal error: %s\n", who.c_str(), e.what());
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) {
  choose_openblas_kernels(argv);
  choose_device_connections(argc, argv);
  try {
    megaton::dist::init(&argc, &argv);  // MPI under mpirun/srun only
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 1;
  }
  CLI::App app{"Megaton: train dense and mixture-of-experts GPT models"};
  app.require_subcommand(1);
  megaton::cli::add_train_command(app);
  megaton::cli::add_generate_command(app);
  megaton::cli::add_preprocess_command(app);
  megaton::cli::add_tokenizer_command(app);
  megaton::cli::add_convert_command(app);
  const int status = run(app, argc, argv);
  // A failed rank leaves without MPI_Finalize: its non-zero exit makes mpirun end the
  // job, where finalizing could wait forever on ranks stuck in a collective.
  if (status == 0) {
    try {
      megaton::dist::finalize();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "internal error: %s\n", e.what());
      return 1;
    }
  }
  return status;
}
