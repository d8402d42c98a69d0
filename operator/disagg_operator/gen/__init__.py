"""Generated files (`make generate`): the CRD and its structural schema checks (`crd`,
`crdschema`), the reference and contract docs (`docgen`), the install manifest (`install`).
Beside app at the top; may import plan, k8s and names, never reconcile or app."""
