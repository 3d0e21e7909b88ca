//! Where the configuration file is found (`--config`, `FENCEGATE_CONFIG`, the
//! default places).

use super::*;

/// Where the config file was found (SPEC §8): the first of `--config`,
/// `$FENCEGATE_CONFIG`, `./fencegate.toml`, `./config/fencegate.toml` and
/// `/etc/fencegate/fencegate.toml` that is given or exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The file, absolute (so are the paths resolved against it).
    pub path: PathBuf,
    /// How it was chosen, for the first log line: `--config`,
    /// `$FENCEGATE_CONFIG` or `default`.
    pub via: &'static str,
}

/// The environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "FENCEGATE_CONFIG";

/// The default places, after `--config` and `$FENCEGATE_CONFIG`, in order.
pub const DEFAULT_PLACES: [&str; 3] = [
    "fencegate.toml",
    "config/fencegate.toml",
    "/etc/fencegate/fencegate.toml",
];

/// Finds the config file: `explicit` (`--config`) if given, else `env` (the
/// value of `$FENCEGATE_CONFIG`, if set and not empty), else the first of
/// [`DEFAULT_PLACES`] that `exists` (relative ones against the working
/// directory). The file itself is not read: a given path that does not exist is
/// reported when it is loaded.
pub fn locate(
    explicit: Option<PathBuf>,
    env: Option<std::ffi::OsString>,
    exists: impl Fn(&Path) -> bool,
) -> Result<Located, ConfigError> {
    let absolute = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    if let Some(p) = explicit {
        return Ok(Located {
            path: absolute(p),
            via: "--config",
        });
    }
    if let Some(p) = env.filter(|v| !v.is_empty()) {
        return Ok(Located {
            path: absolute(PathBuf::from(p)),
            via: "$FENCEGATE_CONFIG",
        });
    }
    for place in DEFAULT_PLACES {
        if exists(Path::new(place)) {
            return Ok(Located {
                path: absolute(PathBuf::from(place)),
                via: "default",
            });
        }
    }
    Err(ConfigError::NotFound {
        tried: format!(
            "no --config, {CONFIG_ENV} unset, and none of {} exists",
            DEFAULT_PLACES.join(", ")
        ),
    })
}

/// A path as the summary shows it: resolved the way the OS will (symlinks and
/// `..` of its nearest existing ancestor), so an operator sees where it is.
pub(super) fn shown(p: &Path) -> String {
    let mut rest = Vec::new();
    let mut at = p;
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            let mut out = real;
            out.extend(rest.iter().rev());
            return out.display().to_string();
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                at = parent;
            }
            _ => return p.display().to_string(),
        }
    }
}
