// MPI start and end, world coordinates, local GPU selection.
#include "dist/runtime.h"

#include <mpi.h>

#include <cstdint>
#include <cstdlib>

#include "dist/mpi_util.h"
#ifdef MEGATON_WITH_CUDA
#include "core/cuda/cuda_check.h"
#endif

namespace megaton::dist {

namespace {
struct State {
  bool done = false;     // init() ran
  bool started = false;  // init() called MPI_Init_thread
  int rank = 0;
  int size = 1;
  int local_rank = 0;
};
State& state() {
  static State s;
  return s;
}

// The first of `names` that is set, as an integer; -1 when none is.
int env_int(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return -1;
}
}  // namespace

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(name)) return true;
  return std::getenv("SLURM_NTASKS") && std::getenv("SLURM_STEP_NUM_TASKS");
}

void init(int* argc, char*** argv) {
  State& s = state();
  if (s.done || !launched_by_mpi()) return;
  s.done = true;
  int already = 0;
  MEGATON_MPI_CHECK(MPI_Initialized(&already));
  if (!already) {
    int provided = 0;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) throw InternalError(fmt::format("MPI_Init_thread failed ({})", rc));
    s.started = true;
  }
  MEGATON_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  MEGATON_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &s.rank));
  MEGATON_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &s.size));
  s.local_rank = env_int({"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"});
  if (s.local_rank < 0) {  // a launcher we do not know: ask MPI which ranks share this node
    MPI_Comm node;
    MEGATON_MPI_CHECK(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, s.rank, MPI_INFO_NULL, &node));
    MEGATON_MPI_CHECK(MPI_Comm_rank(node, &s.local_rank));
    MEGATON_MPI_CHECK(MPI_Comm_free(&node));
  }
#ifdef MEGATON_WITH_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0)
    MEGATON_CUDA_CHECK(cudaSetDevice(s.local_rank % devices));
  else
    (void)cudaGetLastError();  // no GPU: a CPU run
#endif
}

bool mpi_active() {
  if (!state().started) return false;
  int finalized = 0;
  MEGATON_MPI_CHECK(MPI_Finalized(&finalized));
  return !finalized;
}

int world_rank() { return state().rank; }
int world_size() { return state().size; }
int local_rank() { return state().local_rank; }

std::string broadcast_from_rank0(const std::string& s) {
  if (!mpi_active()) return s;
  uint64_t size = s.size();
  MEGATON_MPI_CHECK(MPI_Bcast(&size, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD));
  std::string out = world_rank() == 0 ? s : std::string(size, '\0');
  if (size > 0) MEGATON_MPI_CHECK(MPI_Bcast(out.data(), int(size), MPI_CHAR, 0, MPI_COMM_WORLD));
  return out;
}

void world_barrier() {
  if (mpi_active()) MEGATON_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
}

void finalize() {
  if (!mpi_active()) return;
  MEGATON_MPI_CHECK(MPI_Finalize());
}

}  // namespace megaton::dist
