//! Finding and loading the NIXL runtime before the first `nixl-sys` call.
//!
//! `nixl-sys` is built with its stub API: at its first call it `dlopen`s `libnixl_capi.so`
//! *by name* and aborts the process when that fails. This module owns everything that must
//! happen before that point: it locates the library (`RESHARD_NIXL_HOME`, else the loader's
//! search path; never a path compiled in, so an installed build finds what is installed where it
//! runs: cargo sets `RESHARD_NIXL_HOME` to the checkout's `.deps/nixl` in `.cargo/config.toml`, and
//! the Python package to the `nixl-cu12` package installed beside it), `dlopen`s it by absolute path with
//! `RTLD_LOCAL` and keeps the handle for the life of the process, so the stub's later
//! `dlopen("libnixl_capi.so")` finds the already-loaded object by its soname. Only then is
//! `nixl_sys::is_stub()` asked, which never aborts. Every failure is a typed `Unavailable`
//! error saying how to install the runtime.

use reshard_core::{Error, ErrorKind, Result};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::SCHEME;

/// Environment variable naming the NIXL runtime folder (a `nixl-cu12` wheel unpacked with
/// `pip install --target`, or an install prefix with `lib/`).
pub const HOME_ENV: &str = "RESHARD_NIXL_HOME";

/// File name (and soname) of the NIXL C API library the stubs forward to.
const CAPI: &str = "libnixl_capi.so";

/// How to get the runtime, appended to every `Unavailable` message.
const INSTALL_HINT: &str = "install the nixl-cu12 wheel (`pip install reshard[nixl]` for the \
                            Python package; in a checkout, `bash scripts/install-deps.sh` puts it \
                            in .deps/nixl, which cargo points RESHARD_NIXL_HOME at) or point \
                            RESHARD_NIXL_HOME at a NIXL install";

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
/// library); `Ok(None)` without a home, when the loader's search path (`LD_LIBRARY_PATH`) is the
/// last resort. An explicit home without the library is an `Unavailable` error: a wrong override
/// should not silently pick up another NIXL.
pub fn locate(home: Option<&Path>) -> Result<Option<PathBuf>> {
    let Some(home) = home else {
        return Ok(None);
    };
    match candidates(home).into_iter().find(|p| p.is_file()) {
        Some(p) => Ok(Some(p)),
        None => Err(unavailable(format!(
            "{HOME_ENV}={} holds no {CAPI}",
            home.display()
        ))),
    }
}

fn unavailable(why: String) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!("the NIXL runtime is not available: {why}; {INSTALL_HINT}"),
    )
    .with_backend(SCHEME)
}

/// The loaded runtime: where it came from, and the library handles kept open for the process.
pub(crate) struct Runtime {
    /// Path of the library, or a note that the loader's search path provided it.
    pub(crate) source: String,
    /// The folder NIXL loads its plugins from: `NIXL_PLUGIN_DIR` of the process environment,
    /// else `plugins/` next to the library (`None` when the loader's search path found it).
    pub(crate) plugin_dir: Option<PathBuf>,
    /// Never closed: the stubs hold function pointers into it for the rest of the process.
    _lib: Option<libloading::os::unix::Library>,
    /// The wheel's UCX core library, configured before the UCX plugin uses it (see
    /// [`configure_wheel_ucx`]); kept open so the plugin finds this very object by its soname.
    _ucs: Option<libloading::Library>,
}

static RUNTIME: OnceLock<std::result::Result<Runtime, (ErrorKind, String)>> = OnceLock::new();
/// Serialises the first load.
static INIT: Mutex<()> = Mutex::new(());

/// Loads the runtime once per process (idempotent) and checks `plugin_dir` against the folder
/// NIXL uses.
///
/// This never changes the process environment: `std::env::set_var` in a process whose other
/// threads may read the environment (tokio workers, NIXL and UCX threads, `getenv` in C code)
/// is unsound. NIXL's plugin manager takes its folder from `NIXL_PLUGIN_DIR` when the first
/// agent is created, and neither the C API nor the agent configuration can pass one, so a
/// `plugin_dir` must be the folder NIXL will use anyway: `NIXL_PLUGIN_DIR` as the process was
/// started with, or `plugins/` next to the library; anything else is a `Config` error saying
/// to set `NIXL_PLUGIN_DIR` when starting the process.
pub(crate) fn ensure(plugin_dir: Option<&Path>) -> Result<&'static Runtime> {
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let rt = RUNTIME.get_or_init(|| load().map_err(|e| (e.kind(), e.message().into())));
    match rt {
        Ok(rt) => {
            if let Some(want) = plugin_dir {
                check_plugin_dir(want, rt.plugin_dir.as_deref())?;
            }
            Ok(rt)
        }
        Err((kind, msg)) => Err(Error::new(*kind, msg.clone()).with_backend(SCHEME)),
    }
}

/// `want` (the `plugin_dir` option) must be the folder NIXL uses (`used`).
fn check_plugin_dir(want: &Path, used: Option<&Path>) -> Result<()> {
    if !want.is_dir() {
        return Err(Error::new(
            ErrorKind::Config,
            format!("plugin_dir {} is not a folder", want.display()),
        )
        .with_backend(SCHEME));
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if used.is_some_and(|u| same(u, want)) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Config,
        format!(
            "plugin_dir {} is not the folder NIXL loads plugins from ({}); NIXL reads it only \
             from the NIXL_PLUGIN_DIR environment variable, which reshard does not change in a \
             running process: start the process with NIXL_PLUGIN_DIR={}",
            want.display(),
            used.map_or_else(
                || "the plugins next to libnixl.so".to_string(),
                |p| p.display().to_string()
            ),
            want.display()
        ),
    )
    .with_backend(SCHEME))
}

/// Where the runtime was loaded from, once it has been loaded successfully.
pub fn loaded_from() -> Option<&'static str> {
    RUNTIME.get()?.as_ref().ok().map(|r| r.source.as_str())
}

fn load() -> Result<Runtime> {
    let home = std::env::var_os(HOME_ENV)
        .filter(|h| !h.is_empty())
        .map(PathBuf::from);
    let path = locate(home.as_deref())?;
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
    let ucs = match &path {
        Some(p) if is_wheel(p) => configure_wheel_ucx(p),
        _ => None,
    };
    // Never aborts: with the library already loaded the stub's dlopen by soname finds it;
    // otherwise it tries the loader's search path and reports failure.
    if nixl_sys::is_stub() {
        return Err(unavailable(format!(
            "{HOME_ENV} is not set and {CAPI} is not on the loader's search path (LD_LIBRARY_PATH)"
        )));
    }
    let source = path.as_ref().map_or_else(
        || format!("{CAPI} from the loader's search path"),
        |p| p.display().to_string(),
    );
    // NIXL's own lookup: NIXL_PLUGIN_DIR (read, never written), else plugins/ next to it.
    let plugin_dir = std::env::var_os("NIXL_PLUGIN_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            path.as_ref()
                .and_then(|p| Some(p.parent()?.join("plugins")))
        });
    tracing::debug!(%source, "nixl runtime loaded");
    Ok(Runtime {
        source,
        plugin_dir,
        _lib: lib,
        _ucs: ucs,
    })
}

/// Configures the UCX the wheel bundles before the UCX plugin uses it, without touching the
/// environment: the wheel's libucs is loaded here, by absolute path and before any NIXL agent
/// exists (its constructor reads the `UCX_*` environment once), and then
///
/// - its `efa` module is left out, as `UCX_MODULES=^efa` would, unless the user chose the
///   modules (`UCX_MODULES` set). The wheel bundles UCX and its own libibverbs/libnl; its
///   `ib_efa` module also needs the system's libefa, which pulls in the system's libibverbs and
///   a second libnl-route; the two libnl-route copies then corrupt each other's lists and crash
///   in their exit destructors (SIGSEGV in rtnl_tc_unregister after main returns). EFA is
///   served by NIXL's LIBFABRIC plugin. The global `MODULES` option is set through
///   `ucs_global_opts_set_value`; UCX consults it only when it loads its transport modules,
///   inside `ucp_init` of the UCX plugin, which finds this same library object by its soname;
/// - its log goes to stderr instead of stdout (`reshard_backend_ucx::ucs_log`), unless the user
///   set `UCX_LOG_FILE` or this libucs was loaded before (by someone else).
///
/// Best effort: a failure is logged, never fatal.
fn configure_wheel_ucx(capi: &Path) -> Option<libloading::Library> {
    let libs = capi.parent()?.parent()?.join("nixl_cu12.libs");
    let ucs = std::fs::read_dir(&libs).ok()?.flatten().find_map(|e| {
        let name = e.file_name();
        let name = name.to_str()?;
        (name.starts_with("libucs-") && name.contains(".so")).then(|| e.path())
    })?;
    let was_loaded = reshard_backend_ucx::ucs_log::is_loaded(ucs.as_os_str());
    // SAFETY: libucs' initialisers set up UCX's globals (configuration parsed from the
    // environment, logging); they start no thread that outlives the call. RTLD_LOCAL keeps its
    // symbols private, as for the C API library.
    let lib = match unsafe {
        libloading::os::unix::Library::open(
            Some(ucs.as_os_str()),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    } {
        Ok(l) => libloading::Library::from(l),
        Err(e) => {
            tracing::warn!(%e, "nixl: cannot load the wheel's libucs to configure it");
            return None;
        }
    };
    if std::env::var_os("UCX_MODULES").is_none() {
        exclude_efa(&lib);
    }
    if !was_loaded && !reshard_backend_ucx::ucs_log::user_chose_log_file() {
        reshard_backend_ucx::ucs_log::log_to_stderr(&lib);
    }
    Some(lib)
}

/// Leaves the `efa` module out of the libucs `lib` (see [`configure_wheel_ucx`]).
fn exclude_efa(lib: &libloading::Library) {
    // `ucs_status_t ucs_global_opts_set_value(const char *name, const char *value)`;
    // `ucs_status_t` is a packed (one byte) enum, UCS_OK = 0.
    type SetValue =
        unsafe extern "C" fn(*const libc::c_char, *const libc::c_char) -> std::ffi::c_schar;
    // SAFETY: the symbol has this C signature in every UCX release that has it.
    let status = unsafe {
        match lib.get::<SetValue>(b"ucs_global_opts_set_value\0") {
            Ok(set) => Some(set(c"MODULES".as_ptr(), c"^efa".as_ptr())),
            Err(_) => None,
        }
    };
    if status != Some(0) {
        tracing::warn!(
            ?status,
            "nixl: could not exclude the wheel's UCX efa module (ucs_global_opts_set_value)"
        );
    }
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
        let e = locate(Some(&empty)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.message().contains("install-deps.sh"), "{e}");
        assert!(e.message().contains("reshard[nixl]"), "{e}");
        // No home: rely on the loader's search path (no folder compiled in).
        assert_eq!(locate(None).unwrap(), None);
        std::fs::remove_dir_all(&empty).ok();
    }

    #[test]
    fn wheel_layout_is_found() {
        let home = std::env::temp_dir().join(format!("reshard-nixl-fake-{}", std::process::id()));
        let dir = home.join(".nixl_cu12.mesonpy.libs");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(CAPI), b"").unwrap();
        assert_eq!(locate(Some(&home)).unwrap(), Some(dir.join(CAPI)));
        std::fs::remove_dir_all(&home).ok();
    }
}
