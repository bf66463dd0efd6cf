-- Argo CD health check for mooncake.io/MooncakeCluster (Lua 5.1, as Argo CD runs it).
-- Reads the conditions the operator writes (operator/status.py): Stalled (an invalid spec)
-- and Degraded (pods crash-looping, images that do not pull, RDMA devices missing) make the
-- cluster Degraded; Ready=True with no rollout in progress makes it Healthy; a cluster parked
-- at zero replicas is Suspended; anything else is Progressing with the operator's reason.
-- Install: deploy/gitops/argocd-cm.yaml (docs/gitops.md).
local hs = {status = "Progressing", message = "Waiting for the Mooncake operator to report status"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata and obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.message = "Waiting for the Mooncake operator to observe generation " .. tostring(generation)
  return hs
end
local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  if c.type ~= nil then
    conditions[c.type] = c
  end
end
local function is_true(name)
  return conditions[name] ~= nil and conditions[name].status == "True"
end
local function describe(name)
  local c = conditions[name]
  local text = name
  if c.reason ~= nil and c.reason ~= "" then
    text = text .. " (" .. c.reason .. ")"
  end
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end
if is_true("Stalled") then
  hs.status = "Degraded"
  hs.message = describe("Stalled")
  return hs
end
if is_true("Degraded") then
  hs.status = "Degraded"
  hs.message = describe("Degraded")
  return hs
end
if is_true("Progressing") then
  hs.message = describe("Progressing")
  return hs
end
if is_true("Ready") then
  hs.status = "Healthy"
  hs.message = describe("Ready")
  return hs
end
if conditions["Ready"] ~= nil and conditions["Ready"].reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = describe("Ready")
  return hs
end
if conditions["Ready"] ~= nil then
  hs.message = describe("Ready")
end
return hs
