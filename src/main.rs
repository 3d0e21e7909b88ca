//! The `fencegate` binary: parse the command line and hand over to [`fencegate::cli`].

use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: the request path allocates and frees many
/// small, short-lived buffers across threads, where glibc spent ~10% of a
/// forwarded request's CPU (malloc, free, malloc_consolidate). The `system-alloc`
/// feature keeps glibc's, for heaptrack (it hooks malloc, not mimalloc).
#[cfg(not(feature = "system-alloc"))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The commit this binary was built from, for `--version` and
/// `fencegate_build_info`: `FENCEGATE_COMMIT` in the build's environment
/// (the Dockerfile and scripts/image.sh pass it), else "dev".
///
/// Read here, in the binary's own crate, and nowhere else: rustc records the
/// variable in this crate's dep-info only, so a new stamp relinks the binary
/// and rebuilds nothing else — no build script whose rerun would recompile the
/// library, every test binary and the benches on each commit.
const COMMIT: &str = match option_env!("FENCEGATE_COMMIT") {
    Some(c) if !c.is_empty() => c,
    _ => "dev",
};

fn main() -> ExitCode {
    fencegate::cli::main(COMMIT)
}
