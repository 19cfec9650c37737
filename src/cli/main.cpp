// `megaton`: the command-line entry point. User errors exit 2, internal errors exit 1.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"Megaton: train dense and mixture-of-experts GPT models"};
  app.require_subcommand(1);
  megaton::cli::add_train_command(app);
  megaton::cli::add_generate_command(app);
  megaton::cli::add_preprocess_command(app);
  megaton::cli::add_tokenizer_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s (see --help)\n", e.what());
    return 2;
  } catch (const megaton::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
