//! Artifacts are created if absent, never overwritten, and read back by the
//! object store like any other object.

use leasehold_testkit::doors::artifacts::{Artifacts, NewArtifact, Written};
use tokio::io::AsyncReadExt;

use leasehold_testkit::Fleet;

async fn read(a: &Artifacts, name: &str) -> Vec<u8> {
    let mut obj = a.store().get(name).await.unwrap();
    let mut out = Vec::new();
    obj.read_to_end(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn an_artifact_is_created_once_and_the_second_writer_adopts_it() {
    let env = Fleet::start().await;
    let a = Artifacts::open(&env.conn).await.unwrap();
    // Several chunks (the object store's chunk is 128 KiB).
    let first: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let new = |who: &str| NewArtifact {
        name: "j-1/report.md".into(),
        description: Some(format!("written by {who}")),
        metadata: [("lh-title".to_string(), who.to_string())].into(),
    };
    let Written::Created(mine) = a.create(new("A"), &first).await.unwrap() else {
        panic!("the first writer creates")
    };
    assert_eq!(mine.chunks, 3);
    let Written::Existing(theirs) = a.create(new("B"), b"another document").await.unwrap() else {
        panic!("the second writer finds the first one's artifact")
    };
    assert_eq!(theirs.nuid, mine.nuid);
    assert_eq!(read(&a, "j-1/report.md").await, first);
    let info = a.store().info("j-1/report.md").await.unwrap();
    assert_eq!(info.metadata["lh-title"], "A");
    assert_eq!(info.digest, mine.digest);
    let mut s = env
        .conn
        .js
        .get_stream(format!("OBJ_{}", env.conn.layout.artifacts_bucket()))
        .await
        .unwrap();
    let messages = s.info().await.unwrap().state.messages;
    assert_eq!(messages, 3 + 1, "the loser's chunk was purged");
    // A deleted artifact may be created again, still conditionally.
    a.store().delete("j-1/report.md").await.unwrap();
    assert!(matches!(
        a.create(new("C"), b"after a delete").await.unwrap(),
        Written::Created(_)
    ));
    assert_eq!(read(&a, "j-1/report.md").await, b"after a delete");
}
