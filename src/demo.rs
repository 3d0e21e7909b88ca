//! `fencegate demo`: the SPEC §1 story end to end (filled in by the worker-side work).

pub async fn run() -> anyhow::Result<bool> {
    anyhow::bail!("the demo is not built yet")
}
