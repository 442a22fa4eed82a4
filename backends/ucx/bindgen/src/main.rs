//! Regenerates the UCP bindings of `reshard-backend-ucx` from the installed UCX headers
//! (Debian's libucx-dev): a minimal allowlist of functions, emitted as a struct loaded at run
//! time with `libloading` (never linked; see the crate README "Why libucp is loaded at run
//! time"), plus a table of `ucs_status_t` names so errors can say `UCS_ERR_UNREACHABLE` instead
//! of `-6`. Both files are checked in under `src/raw/`; run through
//! `scripts/gen-ucx-bindings.sh` (which also checks that they are current with `--check`).
//!
//! Usage: `reshard-ucx-bindgen OUT_DIR` writes `OUT_DIR/ucp_bindings.rs` and
//! `OUT_DIR/status_names.rs`.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bindgen::callbacks::{EnumVariantValue, ParseCallbacks};

/// The only UCP functions the crate calls; `dynamic_link_require_all` makes loading fail
/// cleanly (rather than a call panic later) when any of them is missing.
const FUNCTIONS: &[&str] = &[
    "ucp_get_version",
    "ucp_config_read",
    "ucp_config_modify",
    "ucp_config_release",
    "ucp_init_version",
    "ucp_cleanup",
    "ucp_context_query",
    "ucp_worker_create",
    "ucp_worker_destroy",
    "ucp_worker_query",
    "ucp_worker_release_address",
    "ucp_worker_progress",
    "ucp_worker_get_efd",
    "ucp_worker_arm",
    "ucp_worker_flush_nbx",
    "ucp_ep_create",
    "ucp_ep_close_nbx",
    "ucp_ep_flush_nbx",
    "ucp_mem_map",
    "ucp_mem_unmap",
    "ucp_mem_query",
    "ucp_rkey_pack",
    "ucp_rkey_buffer_release",
    "ucp_ep_rkey_unpack",
    "ucp_rkey_destroy",
    "ucp_rkey_ptr",
    "ucp_get_nbx",
    "ucp_request_check_status",
    "ucp_request_cancel",
    "ucp_request_free",
];

/// Collects `ucs_status_t` variant names as bindgen parses them.
#[derive(Debug, Default)]
struct StatusNames(Arc<Mutex<Vec<(i64, String)>>>);

impl ParseCallbacks for StatusNames {
    fn enum_variant_name(
        &self,
        _enum_name: Option<&str>,
        name: &str,
        value: EnumVariantValue,
    ) -> Option<String> {
        let is_status =
            name == "UCS_OK" || name == "UCS_INPROGRESS" || name.starts_with("UCS_ERR_");
        if let (true, EnumVariantValue::Signed(v)) = (is_status, value) {
            if let Ok(mut names) = self.0.lock() {
                if !names.iter().any(|(known, _)| *known == v) {
                    names.push((v, name.to_owned()));
                }
            }
        }
        None
    }
}

fn include_dir() -> PathBuf {
    if let Some(home) = env::var_os("UCX_HOME") {
        return PathBuf::from(home).join("include");
    }
    let pc = std::process::Command::new("pkg-config")
        .args(["--variable=includedir", "ucx"])
        .output();
    match pc {
        Ok(out) if out.status.success() => {
            let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if dir.is_empty() {
                PathBuf::from("/usr/include")
            } else {
                PathBuf::from(dir)
            }
        }
        _ => PathBuf::from("/usr/include"),
    }
}

/// Version of the UCX whose headers are read, as pkg-config reports it (for the file header).
fn ucx_version() -> String {
    std::process::Command::new("pkg-config")
        .args(["--modversion", "ucx"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn main() {
    let out = PathBuf::from(
        env::args_os()
            .nth(1)
            .expect("usage: reshard-ucx-bindgen OUT_DIR"),
    );
    let inc = include_dir();
    let header = inc.join("ucp/api/ucp.h");
    if !header.exists() {
        panic!(
            "UCX headers not found at {} (set UCX_HOME or install libucx-dev: \
             bash scripts/install-deps.sh)",
            header.display()
        );
    }

    let names = Arc::new(Mutex::new(Vec::new()));
    let mut builder = bindgen::Builder::default()
        .header_contents("reshard_ucx.h", "#include <ucp/api/ucp.h>\n")
        .clang_arg(format!("-I{}", inc.display()))
        .parse_callbacks(Box::new(StatusNames(Arc::clone(&names))))
        .dynamic_library_name("UcpLib")
        .dynamic_link_require_all(true)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_default(true)
        .generate_comments(false)
        .allowlist_var("UCP_API_(MAJOR|MINOR)")
        .allowlist_type("ucs_status_t")
        .allowlist_type("ucs_memory_type(_t)?")
        .allowlist_type("ucs_thread_mode_t")
        .allowlist_type("ucp_params_field")
        .allowlist_type("ucp_feature")
        .allowlist_type("ucp_context_attr_field")
        .allowlist_type("ucp_worker_params_field")
        .allowlist_type("ucp_worker_attr_field")
        .allowlist_type("ucp_ep_params_field")
        .allowlist_type("ucp_err_handling_mode_t")
        .allowlist_type("ucp_ep_close_flags_t")
        .allowlist_type("ucp_mem_map_params_field")
        .allowlist_type("ucp_mem_attr_field")
        // UCP_MEM_MAP_ALLOCATE lives in an anonymous enum.
        .allowlist_var("UCP_MEM_MAP_(NONBLOCK|ALLOCATE|FIXED)")
        .allowlist_type("ucp_op_attr_t");
    for f in FUNCTIONS {
        builder = builder.allowlist_function(f);
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| panic!("bindgen over {}: {e}", header.display()));
    let banner = format!(
        "// Generated by scripts/gen-ucx-bindings.sh from the UCX {} headers; do not edit.\n",
        ucx_version()
    );
    let text = format!("{banner}{}", bindings.to_string());
    std::fs::write(out.join("ucp_bindings.rs"), text).expect("write ucp_bindings.rs");

    let mut table = format!(
        "{banner}\n/// `ucs_status_t` value to its C name, generated from the UCX headers.\n\
         pub(crate) const STATUS_NAMES: &[(i8, &str)] = &[\n"
    );
    let names = names.lock().expect("status names");
    for (v, n) in names.iter() {
        writeln!(table, "    ({v}, {n:?}),").expect("write to String");
    }
    table.push_str("];\n");
    std::fs::write(out.join("status_names.rs"), table).expect("write status_names.rs");
}
