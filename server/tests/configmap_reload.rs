//! Policy reload from a Kubernetes ConfigMap volume, reproduced with real
//! files, real symlinks and the server's real watcher: the kubelet's
//! `AtomicWriter` lays a ConfigMap out as
//!
//! ```text
//! policy.yaml -> ..data/policy.yaml
//! ..data      -> ..2026_11_30_18_00_00.000000001
//! ..2026_11_30_18_00_00.000000001/policy.yaml
//! ```
//!
//! and updates it by writing a new timestamped directory, pointing a
//! `..data_tmp` symlink at it, renaming `..data_tmp` over `..data` (the
//! atomic step) and removing the old directory. No event ever names
//! `policy.yaml` itself.

use crate::contract_support;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;

use contract_support::*;

/// A directory laid out the way the kubelet lays out a ConfigMap volume.
struct ConfigMapVolume {
    dir: PathBuf,
    generation: u32,
    current: Option<PathBuf>,
}

impl ConfigMapVolume {
    fn create(dir: &Path, policy: &str) -> Self {
        let mut volume = Self {
            dir: dir.to_path_buf(),
            generation: 0,
            current: None,
        };
        volume.swap(policy);
        symlink("..data/policy.yaml", dir.join("policy.yaml")).expect("policy.yaml symlink");
        volume
    }

    /// The kubelet's update: new timestamped directory, `..data_tmp`, rename, cleanup.
    fn swap(&mut self, policy: &str) {
        self.generation += 1;
        let name = format!(
            "..2026_11_30_18_00_{:02}.00000000{}",
            self.generation, self.generation
        );
        let fresh = self.dir.join(&name);
        std::fs::create_dir(&fresh).expect("timestamped dir");
        std::fs::write(fresh.join("policy.yaml"), policy).expect("write policy");
        let tmp = self.dir.join("..data_tmp");
        symlink(&name, &tmp).expect("..data_tmp symlink");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("atomic rename over ..data");
        if let Some(old) = self.current.replace(fresh) {
            std::fs::remove_dir_all(old).expect("remove old generation");
        }
    }

    fn policy_path(&self) -> PathBuf {
        self.dir.join("policy.yaml")
    }
}

fn with_default(team_a_spec: &str) -> String {
    format!(
        "{}---\n{}",
        policy_doc("*", ""),
        policy_doc("team-a", team_a_spec)
    )
}

async fn team_a_minimum(h: &Harness) -> serde_json::Value {
    let (status, body) = h.admin_get("/policy").await;
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    json["policies"]["namespaces"]["team-a"]["minimumMatchedTokens"].clone()
}

#[tokio::test]
async fn configmap_symlink_swap_applies_new_policy_and_keeps_last_good_on_error() {
    let volume_dir = tempfile::tempdir().expect("tempdir");
    let mut volume = ConfigMapVolume::create(
        volume_dir.path(),
        &with_default("  minimumMatchedTokens: 7\n"),
    );
    let link = volume.policy_path();
    assert!(
        std::fs::symlink_metadata(&link)
            .expect("lstat")
            .file_type()
            .is_symlink()
    );
    let h = Harness::start_with("", |config| config.index.policy_file = Some(link)).await;
    assert_eq!(team_a_minimum(&h).await, 7);

    // A good update: the new value is applied.
    volume.swap(&with_default("  minimumMatchedTokens: 11\n"));
    eventually("policy from the swapped ..data applied", || async {
        team_a_minimum(&h).await == 11
    })
    .await;
    assert_eq!(
        h.metric("inferencecache_policy_reload_total{result=\"success\"}")
            .await,
        Some(2.0),
        "one reload for one swap"
    );

    // A bad update: rejected, counted, the last good policy stays in force.
    volume.swap(&with_default("  minimumMatchedTokens: -1\n"));
    eventually("bad swapped policy rejected", || async {
        h.metric("inferencecache_policy_reload_total{result=\"error\"}")
            .await
            >= Some(1.0)
    })
    .await;
    assert_eq!(team_a_minimum(&h).await, 11, "last good policy kept");
    let (_, body) = h.admin_get("/policy").await;
    assert!(
        body.contains("spec.minimumMatchedTokens"),
        "error shown: {body}"
    );

    // Fixing it again is picked up, and clears the error.
    volume.swap(&with_default("  minimumMatchedTokens: 13\n"));
    eventually("fixed policy applied", || async {
        team_a_minimum(&h).await == 13
    })
    .await;
    let (_, body) = h.admin_get("/policy").await;
    let json: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert!(json["lastReloadError"].is_null(), "{body}");
    h.stop().await;
}

#[tokio::test]
async fn unrelated_changes_in_the_volume_do_not_reload() {
    let volume_dir = tempfile::tempdir().expect("tempdir");
    let volume = ConfigMapVolume::create(
        volume_dir.path(),
        &with_default("  minimumMatchedTokens: 7\n"),
    );
    let h = Harness::start_with("", |config| {
        config.index.policy_file = Some(volume.policy_path())
    })
    .await;
    std::fs::write(volume_dir.path().join("other.yaml"), "x: 1\n").expect("write other");
    // Give the watcher time to see the event and settle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        h.metric("inferencecache_policy_reload_total{result=\"success\"}")
            .await,
        Some(1.0),
        "only the start-up load"
    );
    assert_eq!(
        h.metric("inferencecache_policy_reload_total{result=\"error\"}")
            .await
            .unwrap_or(0.0),
        0.0
    );
    h.stop().await;
}
