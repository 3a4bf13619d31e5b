//! Compiles `proto/leasehold.proto` with protox (pure Rust, no system `protoc`)
//! and generates prost types that also derive serde, so the same types are the
//! protobuf wire form and the JSON form of the public contract.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_dir.join("leasehold.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&proto_dir])?;

    let mut config = prost_build::Config::new();
    // Every message derives serde; missing fields take their defaults so old
    // records and sparse client JSON both read.
    for msg in [
        "Budget",
        "RetryPolicy",
        "ModelOverrides",
        "JobSpec",
        "JobError",
        "Progress",
        "BudgetUsed",
        "Versions",
        "JobResult",
        "JobRecord",
        "Parent",
    ] {
        config.type_attribute(
            format!(".leasehold.v1.{msg}"),
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        );
    }
    // A submitted spec with a misspelt field is an error, not a silent default.
    config.type_attribute(".leasehold.v1.JobSpec", "#[serde(deny_unknown_fields)]");
    config.type_attribute(".leasehold.v1.Budget", "#[serde(deny_unknown_fields)]");
    config.type_attribute(".leasehold.v1.RetryPolicy", "#[serde(deny_unknown_fields)]");
    config.type_attribute(".leasehold.v1.Parent", "#[serde(deny_unknown_fields)]");
    // JSON-valued fields are JSON text in protobuf and JSON values in JSON.
    for field in [
        ".leasehold.v1.JobSpec.input",
        ".leasehold.v1.JobSpec.metadata",
        ".leasehold.v1.JobResult.output",
    ] {
        config.field_attribute(field, "#[serde(with = \"crate::json_text\")]");
    }
    config.compile_fds(descriptors)?;
    Ok(())
}
