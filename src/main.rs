//! The `fencegate` binary: parse the command line and hand over to [`fencegate::cli`].

use std::process::ExitCode;

fn main() -> ExitCode {
    fencegate::cli::main()
}
