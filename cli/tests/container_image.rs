//! The container images, without a container engine: the final (`FROM
//! scratch`) stage of `Dockerfile` and `Dockerfile.wasm` is read, its root
//! filesystem built from the same artifacts — the `inference-cache` binary
//! for x86_64-unknown-linux-musl (statically linked: no ELF interpreter, no
//! shared libraries) and the filter's `.wasm` — and the binary is run from
//! it with an empty environment: `--version`, then `serve`, answering
//! `/healthz`. As root, it also runs inside the root filesystem (`chroot`)
//! as the image's `USER`, which proves it needs no other file. Where a
//! working podman is installed, the final stage is also built into a real
//! image (from a local context with the same binary) and its configuration
//! checked.
//!
//! The binary is built by this test (debug profile; the Dockerfile builds
//! release) with `musl-gcc` for ring's C code: `scripts/setup-musl.sh`
//! installs the target and the compiler. The filter is built like the
//! Envoy tests build it.

#[path = "../../tests/src/http.rs"]
mod http;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
}

/// The final stage of a Dockerfile: its base, files copied from the build
/// stage (source, destination), user, entrypoint and command.
#[derive(Debug, Default)]
struct FinalStage {
    base: String,
    copies: Vec<(String, String)>,
    user: Option<String>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
}

fn final_stage(path: &Path) -> FinalStage {
    let text = std::fs::read_to_string(path).expect("Dockerfile");
    let joined = text.replace("\\\n", " ");
    let lines: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let start = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM line");
    let mut stage = FinalStage {
        base: lines[start]["FROM ".len()..].trim().to_owned(),
        ..FinalStage::default()
    };
    let json_list = |rest: &str| -> Vec<String> {
        serde_json::from_str(rest.trim()).expect("exec-form JSON list")
    };
    for line in &lines[start + 1..] {
        let (instruction, rest) = line.split_once(' ').unwrap_or((line, ""));
        match instruction {
            "COPY" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                assert!(
                    words[0].starts_with("--from="),
                    "final stage copies only from the build stage: {line}"
                );
                stage
                    .copies
                    .push((words[1].to_owned(), words[2].to_owned()));
            }
            "USER" => stage.user = Some(rest.trim().to_owned()),
            "ENTRYPOINT" => stage.entrypoint = json_list(rest),
            "CMD" => stage.cmd = json_list(rest),
            "EXPOSE" | "LABEL" => {}
            other => panic!(
                "unexpected instruction in the final stage (no RUN: there is no shell): {other}"
            ),
        }
    }
    stage
}

fn cargo(args: &[&str]) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(repo_root())
        .args(args)
        .env("CARGO_TARGET_DIR", target_dir())
        .env("CC_x86_64_unknown_linux_musl", "musl-gcc")
        .status()
        .expect("running cargo");
    assert!(
        status.success(),
        "cargo {args:?} failed (scripts/setup-musl.sh installs the musl target and musl-gcc)"
    );
}

/// ELF64 program header types present in `bytes`.
fn program_header_types(bytes: &[u8]) -> Vec<u32> {
    assert_eq!(&bytes[..4], b"\x7fELF", "an ELF file");
    assert_eq!(bytes[4], 2, "ELF64");
    let read = |at: usize, n: usize| -> u64 {
        bytes[at..at + n]
            .iter()
            .rev()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
    };
    let (phoff, phentsize, phnum) = (
        read(0x20, 8) as usize,
        read(0x36, 2) as usize,
        read(0x38, 2) as usize,
    );
    (0..phnum)
        .map(|i| read(phoff + i * phentsize, 4) as u32)
        .collect()
}

const PT_INTERP: u32 = 3;
const PT_DYNAMIC: u32 = 2;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

#[test]
fn server_image_root_filesystem_runs_the_static_binary() {
    let stage = final_stage(&repo_root().join("Dockerfile"));
    assert_eq!(stage.base, "scratch");
    let user = stage.user.clone().expect("a USER");
    assert!(
        !user.starts_with("0") && !user.starts_with("root"),
        "non-root user: {user}"
    );
    assert_eq!(stage.copies.len(), 1, "only the binary: {:?}", stage.copies);
    let destination = stage.copies[0].1.clone();
    assert_eq!(stage.entrypoint, vec![destination.clone()]);

    cargo(&[
        "build",
        "--target",
        "x86_64-unknown-linux-musl",
        "-p",
        "inference-cache",
        "--bin",
        "inference-cache",
    ]);
    let binary = target_dir().join("x86_64-unknown-linux-musl/debug/inference-cache");
    let bytes = std::fs::read(&binary).expect("musl binary");
    let headers = program_header_types(&bytes);
    assert!(
        !headers.contains(&PT_INTERP),
        "statically linked: no ELF interpreter"
    );
    assert!(
        !headers.contains(&PT_DYNAMIC) || !bytes.windows(9).any(|w| w == b"libc.so.6"),
        "no shared libc"
    );

    let rootfs = tempfile::tempdir().expect("rootfs");
    let inside = rootfs.path().join(destination.trim_start_matches('/'));
    std::fs::create_dir_all(inside.parent().expect("parent")).expect("dirs");
    std::fs::copy(&binary, &inside).expect("copy the binary");
    let entries: Vec<_> = std::fs::read_dir(rootfs.path()).expect("list").collect();
    assert_eq!(entries.len(), 1, "nothing but the binary (no shell)");

    let version = Command::new(&inside)
        .arg("--version")
        .env_clear()
        .current_dir(rootfs.path())
        .output()
        .expect("run --version");
    assert!(version.status.success());
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("inference-cache "));

    // The image's command, on free loopback ports.
    assert_eq!(stage.cmd.first().map(String::as_str), Some("serve"));
    let admin = free_port();
    let mut server = Command::new(&inside)
        .args(["serve", "--grpc-addr=127.0.0.1:0", "--shutdown-delay=0"])
        .arg(format!("--admin-addr=127.0.0.1:{admin}"))
        .env_clear()
        .current_dir(rootfs.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut health = None;
    while Instant::now() < deadline {
        health = http::get_blocking(("127.0.0.1", admin), "/healthz").ok();
        if health.as_ref().is_some_and(|h| h.status == 200) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        health.as_ref().is_some_and(|h| h.status == 200),
        "/healthz from the binary in the image's root filesystem: {health:?}"
    );

    if podman_works() {
        run_with_podman(&stage, &binary);
    }

    // As root: inside the root filesystem, as the image's user.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let chroot = ["/usr/sbin/chroot", "/usr/bin/chroot", "/sbin/chroot"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    if let (true, Some(chroot)) = (root.unwrap_or(false), chroot) {
        // An image's root directory is world-readable; a temporary directory is not.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(rootfs.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod rootfs");
        let output = Command::new(chroot)
            .arg(format!("--userspec={user}"))
            .arg(rootfs.path())
            .arg(&destination)
            .arg("--version")
            .env_clear()
            .output()
            .expect("chroot");
        assert!(
            output.status.success(),
            "runs inside the root filesystem as {user}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(String::from_utf8_lossy(&output.stdout).starts_with("inference-cache "));
    }
}

#[test]
fn filter_image_holds_plugin_wasm_at_the_root() {
    let stage = final_stage(&repo_root().join("Dockerfile.wasm"));
    assert_eq!(stage.base, "scratch");
    assert_eq!(
        stage.copies,
        vec![("/plugin.wasm".to_owned(), "/plugin.wasm".to_owned())],
        "one file, /plugin.wasm: the layout istio-agent's OCI fetcher reads"
    );
    assert!(
        stage.entrypoint.is_empty() && stage.cmd.is_empty(),
        "a data image"
    );
    cargo(&[
        "build",
        "-p",
        "inference-cache-filter",
        "--target",
        "wasm32-wasip1",
        "--profile",
        "wasm",
    ]);
    let module = std::fs::read(target_dir().join("wasm32-wasip1/wasm/inference_cache_filter.wasm"))
        .expect("wasm");
    assert_eq!(
        &module[..8],
        b"\0asm\x01\0\0\0",
        "a wasm module, binary format version 1"
    );
}

/// True when a working podman is installed (`podman info` succeeds).
fn podman_works() -> bool {
    Command::new("podman")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Builds the final stage as an image with podman (its `COPY --from=build`
/// taken from a local context holding the same binary) and checks the image.
fn run_with_podman(stage: &FinalStage, binary: &Path) {
    let context = tempfile::tempdir().expect("context");
    std::fs::copy(binary, context.path().join("inference-cache")).expect("copy");
    let mut containerfile = format!("FROM {}\n", stage.base);
    containerfile.push_str(&format!("COPY inference-cache {}\n", stage.copies[0].1));
    if let Some(user) = &stage.user {
        containerfile.push_str(&format!("USER {user}\n"));
    }
    containerfile.push_str(&format!(
        "ENTRYPOINT {}\n",
        serde_json::to_string(&stage.entrypoint).expect("json")
    ));
    std::fs::write(context.path().join("Containerfile"), containerfile).expect("write");
    let tag = format!(
        "localhost/inference-cache-image-test:{}",
        std::process::id()
    );
    let built = Command::new("podman")
        .args(["build", "--quiet", "-t", &tag])
        .arg(context.path())
        .output()
        .expect("podman build");
    assert!(
        built.status.success(),
        "podman build: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    // Running a container needs more than building one (crun sets rlimits
    // a sandboxed machine may refuse), so the built image's configuration is
    // checked instead; the binary itself ran from the same root filesystem above.
    let inspect = Command::new("podman")
        .args(["image", "inspect", &tag])
        .output()
        .expect("podman image inspect");
    let _ = Command::new("podman").args(["rmi", "-f", &tag]).output();
    assert!(
        inspect.status.success(),
        "podman image inspect: {}",
        String::from_utf8_lossy(&inspect.stderr)
    );
    let images: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("inspect JSON");
    let config = &images[0]["Config"];
    assert_eq!(config["User"].as_str(), stage.user.as_deref());
    assert_eq!(config["Entrypoint"], serde_json::json!(stage.entrypoint));
    assert_eq!(
        images[0]["RootFS"]["Layers"].as_array().map(Vec::len),
        Some(1),
        "one layer: the binary"
    );
}
