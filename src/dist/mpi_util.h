// Checked MPI calls and the MPI communicators of groups (internal to src/dist).
#pragma once
#include <mpi.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/grid.h"

namespace megaton::dist::detail {
inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, length);
}
}  // namespace megaton::dist::detail

// MEGATON_MPI_CHECK(MPI_Comm_rank(comm, &rank)): throws InternalError naming the call,
// the file and line, and MPI's error string and code. Needs MPI_ERRORS_RETURN on the
// communicator (dist::init sets it on the world, MpiGroups on each group's).
#define MEGATON_MPI_CHECK(call)                                                          \
  do {                                                                                   \
    int megaton_mpi_rc_ = (call);                                                        \
    if (megaton_mpi_rc_ != MPI_SUCCESS) {                                                \
      throw ::megaton::InternalError(::fmt::format(                                      \
          "{}:{}: {} failed: {} ({})", __FILE__, __LINE__, #call,                        \
          ::megaton::dist::detail::mpi_error_string(megaton_mpi_rc_), megaton_mpi_rc_)); \
    }                                                                                    \
  } while (0)

namespace megaton::dist::detail {

// Whether MPI is initialized and not yet finalized.
bool mpi_running();

// One MPI communicator per distinct rank list, created on first use with MPI_Group_incl
// + MPI_Comm_create_group (collective over the group's members only, so groups can be
// created in any order that their members agree on) and cached. Rank i of a
// communicator is g.ranks[i]. Communicators are never freed: MPI_Finalize releases
// them, and MPI_Comm_free could block on a rank that is gone after an error.
class MpiGroups {
 public:
  // Throws InternalError when MPI is not running (a group of more than one rank needs
  // mpirun) or this rank is not in g.
  MPI_Comm get(const Group& g);

 private:
  std::map<std::vector<int>, MPI_Comm> comms_;
};

}  // namespace megaton::dist::detail
