//! The `fencegate` binary: parse the command line and hand over to [`fencegate::cli`].

use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: the request path allocates and frees many
/// small, short-lived buffers across threads, where glibc spent ~10% of a
/// forwarded request's CPU (malloc, free, malloc_consolidate). The `system-alloc`
/// feature keeps glibc's, for heaptrack (it hooks malloc, not mimalloc).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // The build stamp (build.rs) is read here, in the binary only.
    fencegate::cli::main(env!("FENCEGATE_COMMIT"))
}
