//! Finding and loading the NIXL runtime before the first `nixl-sys` call.
//!
//! `nixl-sys` is built with its stub API: at its first call it `dlopen`s `libnixl_capi.so`
//! *by name* and aborts the process when that fails. This module owns everything that must
//! happen before that point: it locates the library (`RESHARD_NIXL_HOME`, else the repository's
//! `.deps/nixl`, else the loader's search path), `dlopen`s it by absolute path with
//! `RTLD_LOCAL` and keeps the handle for the life of the process, so the stub's later
//! `dlopen("libnixl_capi.so")` finds the already-loaded object by its soname. Only then is
//! `nixl_sys::is_stub()` asked, which never aborts. Every failure is a typed `Unavailable`
//! error saying how to install the runtime.

use reshard_core::{Error, ErrorKind, Result};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::BACKEND;

/// Environment variable naming the NIXL runtime folder (a `nixl-cu12` wheel unpacked with
/// `pip install --target`, or an install prefix with `lib/`).
pub const HOME_ENV: &str = "RESHARD_NIXL_HOME";

/// File name (and soname) of the NIXL C API library the stubs forward to.
const CAPI: &str = "libnixl_capi.so";

/// How to get the runtime, appended to every `Unavailable` message.
const INSTALL_HINT: &str = "install it with `bash scripts/install-deps.sh` (puts the nixl-cu12 \
                            wheel in .deps/nixl), or point RESHARD_NIXL_HOME at a NIXL install";

/// The repository's default runtime folder, fixed at build time.
fn repo_default() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/nixl")
}

/// Folders inside a runtime home where `libnixl_capi.so` may live: the wheel's layout first,
/// then the usual install prefixes.
fn candidates(home: &Path) -> [PathBuf; 4] {
    [
        home.join(".nixl_cu12.mesonpy.libs").join(CAPI),
        home.join("lib").join(CAPI),
        home.join("lib64").join(CAPI),
        home.join("lib/x86_64-linux-gnu").join(CAPI),
    ]
}

/// Where the C API library is: `Ok(Some(path))` inside `home` (when given, it must hold the
/// library) or inside `fallback`; `Ok(None)` when neither has it and the loader's search path
/// (`LD_LIBRARY_PATH`) is the last resort. An explicit home without the library is an
/// `Unavailable` error: a wrong override should not silently pick up another NIXL.
pub fn locate(home: Option<&Path>, fallback: &Path) -> Result<Option<PathBuf>> {
    if let Some(home) = home {
        return match candidates(home).into_iter().find(|p| p.is_file()) {
            Some(p) => Ok(Some(p)),
            None => Err(unavailable(format!(
                "{HOME_ENV}={} holds no {CAPI}",
                home.display()
            ))),
        };
    }
    Ok(candidates(fallback).into_iter().find(|p| p.is_file()))
}

fn unavailable(why: String) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("the NIXL runtime is not available: {why}; {INSTALL_HINT}"),
    )
    .with_backend(BACKEND)
}

/// The loaded runtime: where it came from, and the library handle kept open for the process.
pub(crate) struct Runtime {
    /// Path of the library, or a note that the loader's search path provided it.
    pub(crate) source: String,
    /// The plugin folder forced through `NIXL_PLUGIN_DIR`, if reshard set it.
    pub(crate) plugin_dir: Option<PathBuf>,
    /// Never closed: the stubs hold function pointers into it for the rest of the process.
    _lib: Option<libloading::os::unix::Library>,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, (ErrorKind, String)>> = OnceLock::new();
/// Serialises the first load so the plugin folder of the first caller wins deterministically.
static INIT: Mutex<()> = Mutex::new(());

/// Loads the runtime once per process (idempotent). `plugin_dir`, when given, is exported as
/// `NIXL_PLUGIN_DIR` (unless that is already set) before any agent exists, because NIXL's
/// plugin manager reads it once, when the first agent is created, and the C API has no other
/// way to pass it. Without it NIXL looks in `plugins/` next to `libnixl.so`, which is where
/// the wheel puts them.
pub(crate) fn ensure(plugin_dir: Option<&Path>) -> Result<&'static Runtime> {
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let rt = RUNTIME.get_or_init(|| load(plugin_dir).map_err(|e| (e.kind(), e.message().into())));
    match rt {
        Ok(rt) => {
            if let Some(want) = plugin_dir {
                if rt.plugin_dir.as_deref() != Some(want) {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "plugin_dir {} must be set before the first NIXL agent of the \
                             process; NIXL already uses {}",
                            want.display(),
                            rt.plugin_dir.as_deref().map_or_else(
                                || "the plugins next to libnixl.so".to_string(),
                                |p| p.display().to_string()
                            )
                        ),
                    )
                    .with_backend(BACKEND));
                }
            }
            Ok(rt)
        }
        Err((kind, msg)) => Err(Error::new(*kind, msg.clone()).with_backend(BACKEND)),
    }
}

/// Where the runtime was loaded from, once it has been loaded successfully.
pub fn loaded_from() -> Option<&'static str> {
    RUNTIME.get()?.as_ref().ok().map(|r| r.source.as_str())
}

fn load(plugin_dir: Option<&Path>) -> Result<Runtime> {
    let home = std::env::var_os(HOME_ENV)
        .filter(|h| !h.is_empty())
        .map(PathBuf::from);
    let path = locate(home.as_deref(), &repo_default())?;
    let lib = match &path {
        Some(p) => {
            // SAFETY: loading a shared library runs its initialisers; libnixl_capi.so is the
            // NIXL C API whose initialisers only set up C++ statics. RTLD_LOCAL keeps its
            // symbols (and its bundled UCX) out of the global namespace, so other UCX users in
            // the process (the ucx backend) are not affected.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(p.as_os_str()),
                    libc::RTLD_NOW | libc::RTLD_LOCAL,
                )
            }
            .map_err(|e| unavailable(format!("cannot load {}: {e}", p.display())))?;
            Some(lib)
        }
        None => None,
    };
    let mut forced = None;
    if let Some(dir) = plugin_dir {
        if !dir.is_dir() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("plugin_dir {} is not a folder", dir.display()),
            )
            .with_backend(BACKEND));
        }
        if std::env::var_os("NIXL_PLUGIN_DIR").is_none() {
            // Done once, under INIT, before any NIXL agent (and its plugin manager) exists.
            std::env::set_var("NIXL_PLUGIN_DIR", dir);
        }
        forced = Some(dir.to_path_buf());
    }
    if path.as_deref().is_some_and(is_wheel) && std::env::var_os("UCX_MODULES").is_none() {
        // The wheel bundles UCX and its own libibverbs/libnl. Its `ib_efa` module also needs
        // the system's libefa, which pulls in the system's libibverbs and a second libnl-route;
        // the two libnl-route copies then corrupt each other's lists and crash in their exit
        // destructors (SIGSEGV in rtnl_tc_unregister after main returns). EFA is served by
        // NIXL's LIBFABRIC plugin, so the UCX `efa` module is left out unless the user chose
        // the modules. Set once, under INIT, before the UCX plugin (and libucs, which reads
        // it) is loaded.
        std::env::set_var("UCX_MODULES", "^efa");
    }
    // Never aborts: with the library already loaded the stub's dlopen by soname finds it;
    // otherwise it tries the loader's search path and reports failure.
    if nixl_sys::is_stub() {
        return Err(unavailable(format!(
            "{CAPI} is neither in {} nor on the loader's search path (LD_LIBRARY_PATH)",
            repo_default().display()
        )));
    }
    let source = path.map_or_else(
        || format!("{CAPI} from the loader's search path"),
        |p| p.display().to_string(),
    );
    tracing::debug!(%source, "nixl runtime loaded");
    Ok(Runtime {
        source,
        plugin_dir: forced,
        _lib: lib,
    })
}

/// True for the pip wheel's layout (its bundled UCX needs the `efa` workaround above).
fn is_wheel(lib: &Path) -> bool {
    lib.parent()
        .and_then(|d| d.file_name())
        .is_some_and(|n| n == ".nixl_cu12.mesonpy.libs")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_home_without_library_is_unavailable() {
        let empty = std::env::temp_dir().join(format!("reshard-nixl-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let e = locate(Some(&empty), &repo_default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.message().contains("install-deps.sh"), "{e}");
        // No home and nothing in the fallback: rely on the loader's search path.
        assert_eq!(locate(None, &empty).unwrap(), None);
        std::fs::remove_dir_all(&empty).ok();
    }

    #[test]
    fn wheel_layout_is_found() {
        let home = std::env::temp_dir().join(format!("reshard-nixl-fake-{}", std::process::id()));
        let dir = home.join(".nixl_cu12.mesonpy.libs");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(CAPI), b"").unwrap();
        assert_eq!(
            locate(Some(&home), Path::new("/nonexistent")).unwrap(),
            Some(dir.join(CAPI))
        );
        assert_eq!(locate(None, &home).unwrap(), Some(dir.join(CAPI)));
        std::fs::remove_dir_all(&home).ok();
    }
}
